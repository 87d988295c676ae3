"""Each dp rank's part of the global batch (Paddle: `dist.shard_dataloader(..., shard_dims="dp")`)."""
from __future__ import annotations

import paddle

from .. import mesh as mesh_lib


def shard_batch(batch, mesh=None, axis=0):
    """This dp rank's equal slice (along `axis`) of a tensor, or of every tensor in a dict/list/tuple.

    Ranks that differ only in mp or sep get the same slice: they work on the same samples.
    """
    mesh = mesh_lib.resolve_mesh(mesh)
    size = mesh_lib.dim_size(mesh, "dp")
    index = mesh_lib.mesh_group(mesh, ["dp"]).index if size > 1 else 0

    def cut(value):
        if isinstance(value, paddle.Tensor):
            if value.shape[axis] % size:
                raise ValueError(f"batch dim {axis} of size {value.shape[axis]} does not split evenly over dp={size}: "
                                 "use a global batch size divisible by dp")
            step = value.shape[axis] // size
            return paddle.slice(value, [axis], [index * step], [(index + 1) * step])
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(cut(v) for v in value)
        return value

    return cut(batch)


def shard_dataloader(loader, mesh=None, axis=0):
    """Iterate `loader` (global batches), yielding this dp rank's part of each."""
    for batch in loader:
        yield shard_batch(batch, mesh, axis)
