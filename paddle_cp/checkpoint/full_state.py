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
        buffer = local if group.index == source else paddle.empty(record.local_shape(), tensor.dtype)
        local = collectives.broadcast(group, buffer, source, tag="state_dict")
    for shard in reversed(record.shards()):
        local = _gathered(shard, local)
    return local if isinstance(local, np.ndarray) else local.numpy()


def _gathered(shard, local):
    """The array whole along the shard's axis from every position's piece (a Tensor or array); uneven
    pieces are padded to one length for the all-gather and trimmed after."""
    local = local if isinstance(local, paddle.Tensor) else paddle.to_tensor(local)
    lengths = [shard.local_length(r) for r in range(shard.group.size)]
    if local.shape[shard.axis] < max(lengths):
        padding = list(local.shape)
        padding[shard.axis] = max(lengths) - local.shape[shard.axis]
        local = paddle.concat([local, paddle.zeros(padding, local.dtype)], axis=shard.axis)
    pieces = [p.numpy() for p in collectives.all_gather(shard.group, local, tag="state_dict")]
    return shard.assemble([p if p.shape[shard.axis] == n else np.take(p, range(n), axis=shard.axis)
                           for p, n in zip(pieces, lengths)])


def full_state_dict(model):
    """{name: numpy array} as the unparallelized model's `state_dict()` would hold."""
    return {name: np.asarray(full_value(value)) for name, value in model.state_dict().items()}
