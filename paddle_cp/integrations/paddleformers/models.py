"""What paddle_cp's core needs to know about every PaddleFormers model family, registered through its interfaces
(PaddleFormers is never imported here: every rule reads the layers it is given):

- its attention modules (`paddleformers.*.<Name>Attention`): softmax attention that ContextParallel routes;
- its fused projections: by their names, as any model's (`gate_up_proj` / `up_gate_proj` gate | up halves, a
  `qkv_proj` q | k | v: api/plan_annotation.py), unless the class's `_gen_aoa_config` (what from_pretrained
  applies) says `fused_qkv`: its columns grouped by k/v head (each head's queries, its key, its value), split
  plainly so each rank holds whole groups.

A family's own facts (its MoE block: how it stores and calls its routed experts) are one file in families/.
"""
from __future__ import annotations

import functools
import re

import paddle_cp as pcp
from paddle_cp.api.plan_annotation import fused_parts_by_name

PACKAGE = "paddleformers."

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
    """The column parts of a PaddleFormers `model`'s fused projections (plan_annotation's rule interface): by
    their names, except a q/k/v weight its class groups by k/v head, split plainly. None for another library's."""
    if not any(type(layer).__module__.startswith(PACKAGE) for layer in model.sublayers(include_self=True)):
        return None
    grouped_qkv = functools.lru_cache(maxsize=None)(lambda: qkv_grouped_by_kv_head(model))  # read only if asked

    def parts(name, layer, parent):
        leaf = name.rpartition(".")[2]
        if not ("gate" in leaf and "up" in leaf) and "qkv" in leaf and leaf in grouped_qkv():
            return None
        return fused_parts_by_name(name, layer, parent)

    return parts


# its SFT loss: the token mean over labels that are not `ignored_index`, or over a given loss_mask
CRITERION = pcp.LossLayer("paddleformers.", ("CriterionLayer",), masks=("loss_mask",),
                          masks_off="use_filtered_label_loss")


def register():
    pcp.register_attention_class(is_attention_class)
    pcp.register_fused_weights(fused_weights)
    pcp.register_loss_layer(CRITERION)
