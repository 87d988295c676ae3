"""Full (single-card) numpy values of a model's state and its optimizer's, on every rank,
one tensor at a time: (key, array) pairs, so a caller that keeps only its part of each
holds one full tensor at a time, not the whole model.

Collective: every rank consumes these in the same order. The optimizer state of a
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
    """(`{param}.{accumulator}_0`, full array) for every parameter some rank holds state for."""
    accumulators = layout.inner_optimizer(optimizer)._accumulators
    params = list(model.named_parameters())
    names = layout.accumulator_names(optimizer)
    present = _present(accumulators, params, names)
    for (key, param), has_state in zip(params, present):
        if not has_state:
            continue  # never stepped (no gradient yet): one card holds no state for it either
        for name in names:
            yield optimizer_key(key, name), _full_accumulator(accumulators, name, param)


def _present(accumulators, params, names):
    """Per parameter, whether any rank holds its state (agreed by all ranks)."""
    stepped = [p.name in accumulators.get(names[0], {}) for _, p in params]
    flags = paddle.to_tensor(np.array(stepped, dtype="int32"))
    group = layout.world_group()
    if group is not None:
        collectives.all_reduce(group, flags, tag="checkpoint_state_present")
    return flags.numpy() > 0


def _full_accumulator(accumulators, name, param):
    """Sent by the rank that steps `param`: its dp owner (levels 1-3), on its first pipeline stage."""
    record = find_record(param)
    if layout.steps_here(param):
        local = accumulators[name][param.name]
    else:  # another dp rank or another stage steps it (any state here is a placeholder): receive
        local = paddle.empty(layout.accumulator_shape(param, name), layout.accumulator_dtype(param, name))
    if record is None:
        return local.numpy()
    if record.dp_owner is not None:
        collectives.broadcast(record.dp_group, local, record.dp_owner, tag="checkpoint_state")
    local = stage_value(param, record, local)
    if record.tp_axis is None or name in layout.SCALAR_ACCUMULATORS:
        return local.numpy()
    return record.assemble([s.numpy() for s in collectives.all_gather(record.mp_group, local, tag="checkpoint_state")])
