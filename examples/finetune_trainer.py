"""Fine-tune a PaddleFormers Llama on packed documents with PaddleFormers' Trainer, run by paddle_cp.

    python -m paddle.distributed.launch --nproc_per_node 4 examples/finetune_trainer.py \
        --output_dir /tmp/finetune --context_parallel_size 2 --max_steps 20

A PaddleFormers training script as it is, but for its two imports: the Trainer and
TrainingArguments come from paddle_cp.integrations.paddleformers. On 4 ranks the flags
above make 2 data-parallel replicas, each running ring attention over 2 ranks. Other
flags work the same way: --sep_parallel_size 2 (Ulysses), both (hybrid),
--tensor_model_parallel_size 2 --sequence_parallel 1, --sharding stage2.
Every argument of PaddleFormers' TrainingArguments is accepted; the defaults below
keep the run to about a minute on a laptop CPU.
"""
from __future__ import annotations

import sys

import numpy as np
from paddleformers.trainer import PdArgumentParser
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

from paddle_cp.integrations.paddleformers import Trainer, TrainingArguments  # the only change

DEFAULTS = dict(output_dir="/tmp/pcp_finetune", context_parallel_size=2, per_device_train_batch_size=2,
                max_steps=20, learning_rate=3e-3, warmup_steps=2, logging_steps=2, save_steps=10,
                seed=2024, report_to="none")
VOCAB, SEQ = 256, 256


def packed_documents(samples, seed):
    """Documents of 16-96 tokens following a fixed rule (learnable), packed back to back into SEQ
    tokens: position_ids restart at each document, `attn_mask_startend_row_indices` keeps attention
    inside it, and each document's last token predicts nothing (-100)."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(samples):
        ids, positions, row_ends, labels = [], [], [], []
        while len(ids) < SEQ:
            length = min(int(rng.integers(16, 97)), SEQ - len(ids))
            doc = (int(rng.integers(VOCAB)) + 5 * np.arange(length + 1)) % VOCAB
            end = len(ids) + length
            ids += doc[:-1].tolist()
            labels += doc[1:-1].tolist() + [-100]
            positions += list(range(length))
            row_ends += [end] * length
        data.append({"input_ids": np.array(ids, "int64"), "labels": np.array(labels, "int64"),
                     "position_ids": np.array(positions, "int64"),
                     "attn_mask_startend_row_indices": np.array([row_ends], "int32")})
    return data


def collate(samples):
    """Stacks each field as it is (PaddleFormers' default collator turns the int32 row indices into int64,
    which its eager attention cannot compare with its int32 rows)."""
    import paddle

    return {key: paddle.to_tensor(np.stack([s[key] for s in samples])) for key in samples[0]}


def main():
    argv = sys.argv[1:]
    given = {arg.split("=")[0].lstrip("-") for arg in argv if arg.startswith("--")}
    argv += [item for key, value in DEFAULTS.items() if key not in given for item in (f"--{key}", str(value))]
    (args,) = PdArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False)
    model = LlamaForCausalLM(config)
    trainer = Trainer(model=model, args=args, train_dataset=packed_documents(64, args.seed), data_collator=collate)
    trainer.train()
    trainer.save_model()  # safetensors + config.json: LlamaForCausalLM.from_pretrained(args.output_dir)


if __name__ == "__main__":
    main()
