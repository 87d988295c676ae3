"""ep_config: expert parallelism's section of the config, checked and turned into plan applications
before anything changes (so a bad one raises on every rank before any collective).

    ep_config = {"degree": E, "parallelize_plan": {"model.layers.*.mlp": ExpertParallel()},
                 "mesh_dims": ["dp", "sep"]}     # optional: the dims the expert groups fold onto
"""
from __future__ import annotations

import math

from .. import mesh as mesh_lib
from ..experts.blocks import find_moe_block, known_blocks
from ..plans.expert_parallel import ExpertFold, ExpertParallel
from .plan_keys import match_layer

KEYS = ("degree", "parallelize_plan", "mesh_dims")
FOLD_DIMS = ("dp", "sep")  # MoE parallel folding: the experts fold onto the ranks attention splits data over


def _fold_dims(section, mesh):
    dims = section.get("mesh_dims", FOLD_DIMS)
    if isinstance(dims, str):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not dims:
        raise TypeError(f"ep_config mesh_dims must be a list of mesh dim names, got {dims!r}")
    for dim in dims:
        if dim not in (*FOLD_DIMS, "cp"):
            raise ValueError(f"ep_config mesh_dims {list(dims)} names {dim!r}: expert groups fold onto the "
                             "data- and context-parallel dims only ('dp', 'sep'), never 'mp' or 'pp' (tensor "
                             "parallel inside experts is an mp_config plan on the expert's layers)")
    return tuple(dims)


def _degree(section, mesh, dims):
    degree = section.get("degree")
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"ep_config degree must be a positive integer (the ranks of an expert group), got {degree!r}")
    sizes = {dim: mesh_lib.dim_size(mesh, dim) for dim in dims}
    folded = math.prod(sizes.values())
    if folded % degree:
        spelled = " x ".join(f"{d}{n}" for d, n in sizes.items())
        raise ValueError(f"ep_config degree {degree} does not divide {spelled} = {folded} ranks: expert groups are "
                         f"{degree} consecutive ranks of the mesh's {'/'.join(dims)} dims; choose a divisor of "
                         f"{folded}")
    return degree


def _plans(key, value):
    plans = list(value) if isinstance(value, (list, tuple)) else [value]
    for plan in plans:
        if not isinstance(plan, ExpertParallel):
            raise TypeError(f"ep_config plan for {key!r} must be paddle_cp.ExpertParallel(), got {type(plan).__name__}")
    return plans


def _moe_blocks(model, key):
    """[(name, layer)] of the MoE blocks `key` names; an error naming what it matched when there is none."""
    matched = [(name, layer) for name, layer in model.named_sublayers() if match_layer(key, name, layer) == []]
    blocks = [(name, layer) for name, layer in matched if find_moe_block(layer) is not None]
    if not blocks:
        what = (f"it matches {sorted({type(layer).__name__ for _, layer in matched})} (e.g. {matched[0][0]})"
                if matched else "it matches no sublayer")
        raise ValueError(f"ep_config key {key!r} names no MoE block: {what}. ExpertParallel applies to the MoE "
                         f"blocks {known_blocks()}, e.g. 'model.layers.*.mlp'")
    return blocks


_ROUTER_STATISTICS_SPLIT = (
    "output_router_logits=True under context parallelism: the router's aux loss is a product of means over all "
    "tokens of a sequence, which no rank holds alone; add ep_config={'degree': 1, 'parallelize_plan': "
    "{'model.layers.*.mlp': pcp.ExpertParallel()}} (any degree: it gathers the router statistics over dp x sep, "
    "as one card sees them), or leave output_router_logits off")


def _refuse_router_statistics_split(model, mesh):
    """Without ep_config nothing gathers the router's statistics: under context parallelism each rank's aux
    loss would be a product of means over its own part of the sequences, not one card's. Refused from the
    model's config now, and from a forward's `output_router_logits=True` when it is called."""
    sep = mesh_lib.find_dim(mesh, "sep")
    if sep is None or mesh_lib.dim_size(mesh, sep) == 1 or not any(find_moe_block(l) for l in model.sublayers()):
        return
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ValueError(_ROUTER_STATISTICS_SPLIT)

    def refuse_keyword(layer, args, kwargs):  # before PrepareContextParallel's (registered later): no collective yet
        if kwargs.get("output_router_logits"):
            raise ValueError(_ROUTER_STATISTICS_SPLIT)

    model.register_forward_pre_hook(refuse_keyword, with_kwargs=True)


def expert_applications(model, config, mesh):
    """[(plan, layer, [])] for ep_config, every one checked; [] without ep_config."""
    section = config.get("ep_config")
    if not section:
        _refuse_router_statistics_split(model, mesh)
        return []
    if not isinstance(section, dict):
        raise TypeError(f"ep_config must be a dict like {{'degree': 2, 'parallelize_plan': {{...}}}}, "
                        f"got {type(section).__name__}")
    unknown = set(section) - set(KEYS)
    if unknown:
        raise ValueError(f"ep_config has unknown keys {sorted(unknown)}: it takes {list(KEYS)}")
    dims = _fold_dims(section, mesh)
    degree = _degree(section, mesh, dims)
    plan = section.get("parallelize_plan")
    if not isinstance(plan, dict) or not plan:
        raise ValueError("ep_config needs a parallelize_plan naming the MoE blocks, e.g. "
                         "{'model.layers.*.mlp': paddle_cp.ExpertParallel()}")
    gather = bool(getattr(getattr(model, "config", None), "output_router_logits", False))
    if gather and config.get("pp_config"):
        raise ValueError("output_router_logits=True with pp_config: the router's aux loss is not carried between "
                         "pipeline stages; build the model with output_router_logits=False")
    fold = ExpertFold(degree, dims, gather)
    applications = []
    for key, value in plan.items():
        plans = _plans(key, value)
        for _, layer in _moe_blocks(model, key):
            for user_plan in plans:
                bound = user_plan.folded(fold)
                bound.check(layer, mesh)
                applications.append((bound, layer, []))
    return applications
