"""Build a small Llama (PaddleFormers' or the project's own) and its context-parallel plan."""
from __future__ import annotations

import importlib.util

from tiny_llama import TinyLlamaConfig, TinyLlamaForCausalLM

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def paddleformers_available():
    return importlib.util.find_spec("paddleformers") is not None


def build_llama(source="auto", **sizes):
    """`paddleformers`, `tiny`, or `auto` (PaddleFormers when installed)."""
    if source == "auto":
        source = "paddleformers" if paddleformers_available() else "tiny"
    sizes = {**SIZES, **sizes}
    if source == "tiny":
        return TinyLlamaForCausalLM(TinyLlamaConfig(**sizes))
    if source != "paddleformers":
        raise ValueError(f"unknown model source {source!r}: use 'paddleformers', 'tiny' or 'auto'")
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**sizes, fuse_rms_norm=False, _attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def loss_of(output):
    """Both model families return (loss, logits, ...) when given labels."""
    return output[0]
