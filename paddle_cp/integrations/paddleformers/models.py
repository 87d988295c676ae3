"""What paddle_cp's core needs to know about PaddleFormers' model families, registered through its interfaces.

Imported by `paddle_cp` itself (PaddleFormers is never imported here: every rule reads the layers it is given):

- its attention modules (`paddleformers.*.<Name>Attention`): softmax attention that ContextParallel routes;
- its MoE blocks, by class, and how each stores and calls its routed experts (ExpertParallel's seam):
  Qwen2/Qwen3-MoE, DeepSeek-V3, GLM4-MoE call `experts(hidden [T, H], indices [T, k], weights [T, k])` when the
  block's `fd_fallback` is set; gpt-oss calls `experts(hidden [b, s, H], router_indices=[T, k],
  routing_weights=[T, E])` with dense weights;
- its fused projections: `gate_up_proj` / `up_gate_proj` are gate | up halves; a fused `qkv_proj` is q | k | v,
  unless the class's `_gen_aoa_config` (what from_pretrained applies) says `fused_qkv`: its columns grouped by
  k/v head (each head's queries, its key, its value), split plainly so each rank holds whole groups.

A new family is a line here (or a file beside this one when it needs rules of its own).
"""
from __future__ import annotations

import functools
import re

import paddle_cp as pcp

PACKAGE = "paddleformers."

MOE_BLOCKS = (
    # Qwen2/3-MoE return their router logits, but PaddleFormers 1.2.0's decoder layer drops them: no aux loss
    pcp.BlockKind(("Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock"), runs_idle_experts=True,
                  router_output=False, dense_weights=False),
    pcp.BlockKind(("DeepseekV3MoE",), runs_idle_experts=True, router_output=False, dense_weights=False),
    pcp.BlockKind(("Glm4MoeMoE",), runs_idle_experts=False, router_output=False, dense_weights=False),
    pcp.BlockKind(("GptOssMLP",), runs_idle_experts=False, router_output=True, dense_weights=True),
)

# `<...>.qkv_proj.weight, fused_qkv` in an AOA statement: columns by k/v head; `fused_qkv_old`: q | k | v
_AOA_FUSED_QKV = re.compile(r"->\s*[\w.$]*?(?P<leaf>\w+)\.weight\s*,\s*(?P<op>fused_qkv(?:_old)?)\b")


def is_attention_class(cls):
    return cls.__module__.startswith(PACKAGE) and cls.__name__.endswith("Attention")


def qkv_grouped_by_kv_head(model):
    """Leaf names of the fused q/k/v projections whose columns the model groups by k/v head."""
    owner = next((layer for layer in model.sublayers(include_self=True)
                  if hasattr(type(layer), "_gen_aoa_config") and hasattr(layer, "config")), None)
    if owner is None:
        return set()
    statements = type(owner)._gen_aoa_config(owner.config).get("aoa_statements", [])
    matches = (_AOA_FUSED_QKV.search(statement) for statement in statements)
    return {m.group("leaf") for m in matches if m is not None and m.group("op") == "fused_qkv"}


def fused_weights(model):
    """The column parts of `model`'s fused projections (plan_annotation's rule interface)."""
    grouped_qkv = functools.lru_cache(maxsize=None)(lambda: qkv_grouped_by_kv_head(model))  # read only if asked

    def parts(name, layer, parent):
        leaf = name.rpartition(".")[2]
        out = layer.weight.shape[1]
        if "gate" in leaf and "up" in leaf:
            return (out // 2, out // 2)
        if "qkv" not in leaf or leaf in grouped_qkv():
            return None
        heads = getattr(parent, "num_heads", None) or getattr(parent, "num_attention_heads", None)
        kv_heads = getattr(parent, "num_key_value_heads", None) or getattr(parent, "num_kv_heads", None) or heads
        head_dim = getattr(parent, "head_dim", None)
        if not (heads and head_dim) or (heads + 2 * kv_heads) * head_dim != out:
            raise ValueError(f"ColWiseParallel on fused projection {name!r}: cannot tell its q/k/v sizes (its parent "
                             "needs num_heads, num_key_value_heads and head_dim matching the weight); split it into "
                             "q_proj/k_proj/v_proj or leave it unplanned")
        return (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)

    return parts


def register():
    pcp.register_attention_class(is_attention_class)
    for kind in MOE_BLOCKS:
        pcp.register_block_kind(kind)
    pcp.register_fused_weights(fused_weights)
