"""`full_state_dict(model)`: the single-card state dict, on every rank, from local shards.

Collective: every rank of the mesh must call it (in the same order as its other collectives).
"""
from __future__ import annotations

import numpy as np
import paddle

from ..comm import collectives
from ..params import find_record


def full_value(tensor):
    """The full numpy value of a parameter or buffer, from its placements: first this rank's local value
    from where it is kept (a level-3 owner, the first pipeline stage holding it), then every shard
    gathered."""
    record = find_record(tensor)
    if record is None:
        return tensor.numpy()
    local = tensor
    for group, source in record.value_sources():
        # a source without the value (another placement keeps it elsewhere: a pipeline stage's rank that does
        # not own this expert) sends a placeholder; the fetch over that other placement's group fills it in
        keeps = group.index == source and local._is_initialized() and tuple(local.shape) == record.local_shape()
        buffer = local if keeps else paddle.empty(record.local_shape(), tensor.dtype)
        local = collectives.broadcast(group, buffer, source, tag="state_dict")
    for shard in reversed(record.shards()):
        local = _gathered(shard, local)
    return local if isinstance(local, np.ndarray) else local.numpy()


def _gathered(shard, local):
    """The array whole along the shard's axis from every position's piece (a Tensor or array): each position's
    piece broadcast in turn into one array, so one piece is in flight besides it (an all-gather would hold every
    position's, uneven ones padded to the largest: more than the whole tensor again)."""
    local = local if isinstance(local, paddle.Tensor) else paddle.to_tensor(local)
    whole = None
    for position in range(shard.group.size):
        shape = list(local.shape)
        shape[shard.axis] = shard.local_length(position)
        buffer = local if position == shard.group.index else paddle.empty(shape, local.dtype)
        piece = collectives.broadcast(shard.group, buffer, position, tag="state_dict").numpy()
        if whole is None:
            shape[shard.axis] = sum(shard.parts)
            whole = np.empty(shape, piece.dtype)
        shard.put(whole, position, piece)
    return whole


def full_state_dict(model):
    """{name: numpy array} as the unparallelized model's `state_dict()` would hold."""
    return {name: np.asarray(full_value(value)) for name, value in model.state_dict().items()}
