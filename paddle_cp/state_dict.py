"""`full_state_dict(model)`: the single-card state dict, on every rank, from local shards.

Collective: every rank of the mesh must call it (in the same order as its other collectives).
"""
from __future__ import annotations

import numpy as np

from .comm import collectives
from .parameter_fetch import broadcast_full
from .pipeline.ownership import stage_value
from .plans.tensor_parallel import shard_of


def _unsharded(tensor):
    """This rank's full-size copy of a dp-sharded (level 3) parameter, else the tensor itself."""
    sharding = getattr(tensor, "pcp_sharding", None)
    if sharding is None or sharding.level < 3:
        return tensor
    return broadcast_full(tensor, sharding, op="state_dict")


def full_value(tensor):
    """The full numpy value of a parameter or buffer, undoing tensor-parallel and dp sharding."""
    local = stage_value(tensor, _unsharded(tensor))  # pipeline: from the stage holding it
    spec = shard_of(tensor)
    if spec is None:
        return local.numpy()
    shards = collectives.all_gather(spec.group, local, op="state_dict")
    return spec.assemble([s.numpy() for s in shards])


def full_state_dict(model):
    """{name: numpy array} as the unparallelized model's `state_dict()` would hold."""
    return {name: np.asarray(full_value(value)) for name, value in model.state_dict().items()}
