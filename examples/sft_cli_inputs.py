"""What `pcp-train examples/sft_cli.yaml` (PaddleFormers' CLI YAML) reads, made offline:

- `<folder>/model`: a tiny PaddleFormers Llama saved with `save_pretrained`, and a byte-level
  tokenizer built with the `tokenizers` package (256 byte tokens + BOS/EOS/PAD; PaddleFormers'
  `AutoTokenizer` loads it as a `PreTrainedTokenizerFast`);
- `<folder>/train.jsonl`: SFT samples in PaddleFormers' erniekit format, one per line,
  `{"src": [prompt], "tgt": [answer]}`: the prompt names a module of Python's standard library,
  the answer is the start of its source (real text, nothing to download).

    python examples/sft_cli_inputs.py runs/sft_cli
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

SPECIAL = ["<pad>", "<s>", "</s>"]
# model: 2 decoder layers, 4 query heads over 2 k/v heads; the fused RMSNorm kernel is GPU-only
MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, fuse_rms_norm=False, max_position_embeddings=8192)


def byte_tokenizer(special):
    """A byte-level BPE without merges: the `special` tokens (ids 0, 1, ...; each one token wherever a text holds
    it), then every byte a token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(special + sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(special)
    return tokenizer


def write_tokenizer(folder):
    """The byte-level tokenizer with BOS/EOS/PAD. Returns the vocabulary size."""
    tokenizer = byte_tokenizer(SPECIAL)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "model_max_length": MODEL["max_position_embeddings"]}, f)
    return tokenizer.get_vocab_size()


def write_model(folder, vocab_size, seed=0):
    import paddle
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0, **MODEL)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def write_dataset(path, samples, answer_bytes):
    """One sample per stdlib module (sorted by name; the first `samples`, or all), its answer the first
    `answer_bytes` of the file cut at a line end (answers differ in length: packing puts several in a row)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:samples]
    if not files:
        raise ValueError(f"no *.py files in {sysconfig.get_paths()['stdlib']}: the samples are made from them")
    with open(path, "w") as f:
        for module in files:
            text = module.read_text(errors="replace")[:answer_bytes]
            answer = text[: text.rfind("\n") + 1] or text
            f.write(json.dumps({"src": [f"Source of {module.stem}:"], "tgt": [answer]}) + "\n")


def build(folder, samples=None, answer_bytes=600):
    """model/ (weights, config, tokenizer) and train.jsonl under `folder`; returns their paths."""
    model = os.path.join(folder, "model")
    os.makedirs(model, exist_ok=True)
    write_model(model, write_tokenizer(model))
    data = os.path.join(folder, "train.jsonl")
    write_dataset(data, samples, answer_bytes)
    return model, data


if __name__ == "__main__":
    print(*build(sys.argv[1] if len(sys.argv) > 1 else "runs/sft_cli"), sep="\n")
