"""Match `parallelize_plan` keys to sublayers exactly as Paddle does, and warn on keys that match nothing."""
from __future__ import annotations

import difflib
import re
import warnings

import paddle

from ..plans.base import Plan
from ..plans.context_parallel import ContextParallel, PrepareContextParallel
from .paddle_plans import is_paddle_plan, translate

ROOT_KEY = ""  # extension: plans keyed "" apply to the model itself (Paddle excludes the root)
CONTEXT_PLANS = (PrepareContextParallel, ContextParallel)


def plan_key(name):
    """A key matching this layer in every repeated block: model.layers.3.linear_attn -> model.layers.*.linear_attn."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _as_list(key, value):
    plans = value if isinstance(value, (list, tuple)) else [value]
    plans = [translate(key, plan) if is_paddle_plan(plan) else plan for plan in plans]
    for plan in plans:
        if not isinstance(plan, Plan):
            raise TypeError(
                f"plan for {key!r} must be a paddle_cp plan or Paddle's (e.g. paddle_cp.ColWiseParallel(), "
                f"dist.ColWiseParallel()), got {type(plan).__name__}"
            )
    return list(plans)


def _key_matches(key, name):
    return key == name or re.fullmatch(key, name) is not None


def match_layer(key, name, layer):
    """Param names the key selects on this layer ([] = whole layer), or None if it does not match."""
    prefix, _, attr = key.rpartition(".")
    if prefix and isinstance(getattr(layer, attr, None), paddle.Tensor) and _key_matches(prefix, name):
        return [attr]
    return [] if _key_matches(key, name) else None


def resolve_plan(model, plan):
    """[(name, layer, plans, param_names)] in sublayer order, plans in key order."""
    plan = {key: _as_list(key, value) for key, value in plan.items()}
    layers = list(model.named_sublayers())
    if ROOT_KEY in plan:
        layers.insert(0, (ROOT_KEY, model))
    matched, used = [], set()
    for name, layer in layers:
        for key, plans in plan.items():
            if key == ROOT_KEY and name != ROOT_KEY:
                continue
            params = match_layer(key, name, layer)
            if params is not None:
                matched.append((name, layer, plans, params))
                used.add(key)
    for key, plans in plan.items():
        strict = [type(p).__name__ for p in plans if getattr(p, "must_match", False)]
        if key not in used and strict:
            raise ValueError(f"parallelize_plan key {key!r} for {strict[0]} {_why_unmatched(key, layers)}: name "
                             "the layers it applies to, e.g. 'model.layers.*.mlp'")
        if key not in used:
            warnings.warn(f"parallelize_plan key {key!r} {_why_unmatched(key, layers)}", stacklevel=3)
    _require_a_context_plan_applied(model, plan, used, layers)
    return matched


def _require_a_context_plan_applied(model, plan, used, layers):
    """Context-parallel plans none of whose keys matches (a model whose layers are named otherwise) would leave
    every sep rank running the whole sequence, unsplit: an error, not the warnings of single keys."""
    keys = [key for key, plans in plan.items() if any(isinstance(p, CONTEXT_PLANS) for p in plans)]
    if keys and not used.intersection(keys):
        why = "; ".join(f"{key!r} {_why_unmatched(key, layers)}" for key in keys)
        raise ValueError(f"no context-parallel plan applies to {type(model).__name__}: {why}. Every sep rank would "
                         "run the whole sequence unsplit. Key the plans by this model's sublayer names "
                         "(model.named_sublayers(); '' is the model itself)")


def _why_unmatched(key, layers):
    """Paddle applies such a key to nothing; say why: the layer it names lacks that tensor, or no layer is named."""
    prefix, _, attr = key.rpartition(".")
    for name, layer in layers:
        if prefix and _key_matches(prefix, name):
            what = (f"holds a {type(getattr(layer, attr)).__name__}, not a tensor, in" if hasattr(layer, attr)
                    else "has no attribute")
            tensors = [n for n, t in layer._parameters.items() if t is not None]
            return (f"is not applied: {name} {what} {attr!r} (a key ending in a name applies to that tensor "
                    f"of the layer; its parameters are {tensors})")
    names = [n for n, _ in layers if n]
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.4)
    return f"matches no sublayer; closest names: {close or names[:3]}"
