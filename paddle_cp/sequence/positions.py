"""Whole-sequence position ids for models under sequence parallel: a model that derives them
from its embeddings' shape would see [s/mp, b, h] after SequenceParallelBegin."""
from __future__ import annotations

import inspect

import paddle

from ..plans.sequence_parallel import SequenceParallelBegin

_STARTEND = "attn_mask_startend_row_indices"  # PaddleFormers' causal document input: no mask is built


def supply_positions(model, applications):
    """Give whole-sequence position ids to the model layer that holds SequenceParallelBegin, when
    a call has none: models that derive them from their embeddings' shape would see [s/mp, b, h]."""
    parents = {id(child): layer for layer in model.sublayers(include_self=True) for child in layer.children()}
    hooked = set()
    for plan, layer, _ in applications:
        if not isinstance(plan, SequenceParallelBegin):
            continue
        owner = parents.get(id(layer))
        while owner is not None and "position_ids" not in inspect.signature(owner.forward).parameters:
            owner = parents.get(id(owner))
        if owner is not None and id(owner) not in hooked:
            hooked.add(id(owner))
            owner.register_forward_pre_hook(_positions_hook(inspect.signature(owner.forward)), with_kwargs=True)


def _positions_hook(signature):
    def supply(layer, args, kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        _refuse_shape_derived_mask(layer, bound.arguments)
        if bound.arguments.get("position_ids") is not None:
            return None
        tokens = next((bound.arguments[k] for k in ("input_ids", "inputs_embeds")
                       if isinstance(bound.arguments.get(k), paddle.Tensor)), None)
        if tokens is None:
            return None
        batch, seq_len = tokens.shape[0], tokens.shape[1]
        bound.arguments["position_ids"] = paddle.arange(seq_len, dtype="int64").unsqueeze(0).expand([batch, seq_len])
        return bound.args, bound.kwargs
    return supply


def _refuse_shape_derived_mask(layer, arguments):
    """PaddleFormers' eager attention builds its causal mask from the embeddings' shape, split by then."""
    config = getattr(layer, "config", None)
    if getattr(config, "_attn_implementation", None) == "eager" and arguments.get(_STARTEND) is None:
        raise ValueError(f"sequence parallel on {type(layer).__name__}: its eager attention builds the causal mask "
                         "from the [s/mp, b, h] embeddings SequenceParallelBegin makes; build the model with "
                         "_attn_implementation='sdpa' (or pass attn_mask_startend_row_indices)")
