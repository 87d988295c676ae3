"""Full (single-card) numpy values of a model's state and its optimizer's, on every rank,
one tensor at a time: (key, array) pairs, so a caller that keeps only its part of each
holds one full tensor at a time, not the whole model.

Collective: every rank consumes these in the same order. The optimizer state (accumulators, fp32 master weight) of a
parameter comes from the rank that steps it (a broadcast over dp from the owner at
sharding levels 1-3, then over pp from its first stage), then its tensor-parallel
slices are gathered over mp.
"""
from __future__ import annotations

import numpy as np
import paddle

from ..comm import collectives
from ..params import find_record
from ..pipeline.ownership import stage_value
from .full_state import full_value
from . import layout
from .format import optimizer_key


def model_values(model):
    """(key, full array) of every entry of the model's state_dict."""
    for key, value in model.state_dict().items():
        yield key, np.asarray(full_value(value))


def optimizer_values(model, optimizer):
    """(`{param}.{state}_0`, full array) for every parameter some rank holds state for: its accumulators
    and, with multi_precision over float16/bfloat16 parameters, its fp32 master weight (`{param}.w_0`)."""
    params = list(model.named_parameters())
    present = _present(optimizer, params)
    for (key, param), has_state in zip(params, present):
        if not has_state:
            continue  # never stepped (no gradient yet): one card holds no state for it either
        for name in layout.state_names(optimizer, param):
            yield optimizer_key(key, name), _full_state(optimizer, name, param)


def _present(optimizer, params):
    """Per parameter, whether any rank holds its state (agreed by all ranks)."""
    first = layout.accumulator_names(optimizer)[0]
    stepped = [layout.state_tensor(optimizer, p, first) is not None for _, p in params]
    flags = paddle.to_tensor(np.array(stepped, dtype="int32"))
    group = layout.world_group()
    if group is not None:
        collectives.all_reduce(group, flags, tag="checkpoint_state_present")
    return flags.numpy() > 0


def _full_state(optimizer, name, param):
    """Sent by the rank that steps `param`: its dp owner (levels 1-3), on its first pipeline stage."""
    record = find_record(param)
    if layout.steps_here(param):
        local = layout.state_tensor(optimizer, param, name)
    else:  # another dp rank or another stage steps it (any state here is a placeholder): receive
        local = paddle.empty(layout.state_shape(param, name), layout.state_dtype(optimizer, param, name))
    if record is None:
        return local.numpy()
    if record.dp_owner is not None:
        collectives.broadcast(record.dp_group, local, record.dp_owner, tag="checkpoint_state")
    local = stage_value(param, record, local)
    if record.tp_axis is None or name in layout.SCALAR_ACCUMULATORS:
        return local.numpy()
    return record.assemble([s.numpy() for s in collectives.all_gather(record.mp_group, local, tag="checkpoint_state")])
