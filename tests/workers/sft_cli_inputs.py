"""What `paddleformers-cli train` needs, built offline: a tiny Llama saved with save_pretrained, a
word-level tokenizer made with the `tokenizers` package, and an SFT jsonl file in PaddleFormers'
erniekit format ({"src": [prompt], "tgt": [answer]} per line).
"""
import json
import os

import numpy as np

WORDS = [f"w{i}" for i in range(100)]
SPECIAL = ["<unk>", "<pad>", "<s>", "</s>"]
# PaddleFormers' `default` template renders the chat itself; the tokenizer only needs a template to exist
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def write_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 4096,
                   "chat_template": CHAT_TEMPLATE}, f)
    return len(vocab)


def write_model(folder, vocab_size, seed=0):
    import paddle
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False,  # no CPU kernel
                         max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def write_dataset(path, samples=24, seed=0):
    """Prompts and answers of varied lengths, so that packing puts several documents in a row."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(samples):
            src = " ".join(rng.choice(WORDS, rng.integers(3, 12)))
            tgt = " ".join(rng.choice(WORDS, rng.integers(2, 10)))
            f.write(json.dumps({"src": [src], "tgt": [tgt]}) + "\n")


def build(folder):
    """model/ (weights, config, tokenizer) and train.jsonl under `folder`; returns their paths."""
    model = os.path.join(folder, "model")
    os.makedirs(model, exist_ok=True)
    write_model(model, write_tokenizer(model))
    data = os.path.join(folder, "train.jsonl")
    write_dataset(data)
    return model, data
