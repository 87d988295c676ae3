"""`full_state_dict(model)`: the single-card state dict, on every rank, from local shards.

Collective: every rank of the mesh must call it (in the same order as its other collectives).
"""
from __future__ import annotations

import numpy as np

from ..comm import collectives
from ..data_parallel.parameter_fetch import broadcast_full
from ..params import find_record
from ..pipeline.ownership import stage_value


def full_value(tensor):
    """The full numpy value of a parameter or buffer, undoing tensor-parallel and dp sharding."""
    record = find_record(tensor)
    if record is None:
        return tensor.numpy()
    local = broadcast_full(tensor, tag="state_dict") if record.level == 3 else tensor
    local = stage_value(tensor, record, local)  # pipeline: from the stage holding it
    if record.tp_axis is None:
        return local.numpy()
    shards = collectives.all_gather(record.mp_group, local, tag="state_dict")
    return record.assemble([s.numpy() for s in shards])


def full_state_dict(model):
    """{name: numpy array} as the unparallelized model's `state_dict()` would hold."""
    return {name: np.asarray(full_value(value)) for name, value in model.state_dict().items()}
