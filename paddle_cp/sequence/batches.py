"""Each dp rank's part of the global batch: `shard_batch`, and `shard_dataloader` with Paddle's signature.

Rank r of n along the split dim keeps the r-th contiguous slice of every global batch
(what Paddle's DistributedBatchSampler gives it); ranks that differ only in other dims
(mp, sep, pp) get the same samples.
"""
from __future__ import annotations

import paddle
import paddle.distributed as dist

from .. import mesh as mesh_lib


def _slice_batch(batch, index, size, axis=0):
    """Part `index` of `size` (along `axis`) of a tensor, or of every tensor in a dict/list/tuple."""
    def cut(value):
        if isinstance(value, paddle.Tensor):
            if value.shape[axis] % size:
                raise ValueError(f"batch dim {axis} of size {value.shape[axis]} does not split evenly over {size} "
                                 "data-parallel ranks: use a global batch size divisible by dp")
            step = value.shape[axis] // size
            return paddle.slice(value, [axis], [index * step], [(index + 1) * step])
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(cut(v) for v in value)
        return value

    return batch if size == 1 else cut(batch)


def _position(mesh, dim):
    """(this rank's index along mesh dim `dim`, its size); (0, 1) when the mesh has no such dim."""
    name = mesh.dim_names[dim] if isinstance(dim, int) else mesh_lib.find_dim(mesh, dim)
    if name is None:
        return 0, 1
    axis = mesh.dim_names.index(name)
    return mesh_lib.coordinates(mesh)[axis], mesh.shape[axis]


def shard_batch(batch, mesh=None, axis=0):
    """This dp rank's equal slice (along `axis`) of a tensor, or of every tensor in a dict/list/tuple."""
    return _slice_batch(batch, *_position(mesh_lib.resolve_mesh(mesh), "dp"), axis)


def _flat(items):
    flat = []
    for item in items if isinstance(items, (list, tuple)) else [items]:
        flat.extend(_flat(item) if isinstance(item, (list, tuple)) else [item])
    return flat


def _flat_meshes(meshes):
    flat = _flat(meshes)
    for mesh in flat:
        if not isinstance(mesh, dist.ProcessMesh):
            raise TypeError("shard_dataloader meshes must be ProcessMeshes (or lists of them), "
                            f"got {type(mesh).__name__}")
    return flat


def _one_shard_dim(shard_dims, count):
    """Every input is split alike here (the rank's samples are chosen once, as Paddle's sampler does)."""
    if not isinstance(shard_dims, (list, tuple)):
        return shard_dims
    if len(shard_dims) != count:
        raise ValueError(f"shard_dims must be the same length as meshes, got {len(shard_dims)} != {count}")
    dims = set(_flat(shard_dims))
    if len(dims) != 1:
        raise ValueError(f"shard_dims {list(shard_dims)} split inputs of one batch differently: paddle_cp gives each "
                         "rank one set of samples; give one dim (e.g. shard_dims='dp')")
    return dims.pop()


class ShardDataloader:
    """Iterable, and callable as Paddle's (`for batch in loader():`): this rank's part of each global batch."""

    def __init__(self, dataloader, index, size, input_keys):
        self._dataloader, self._index, self._size, self._input_keys = dataloader, index, size, input_keys

    def __len__(self):
        return len(self._dataloader)

    def __iter__(self):
        for batch in self._dataloader:
            if self._input_keys is not None:
                batch = {key: batch[key] for key in self._input_keys}
            yield _slice_batch(batch, self._index, self._size)

    def __call__(self):
        return iter(self)


def shard_dataloader(dataloader, meshes, input_keys=None, shard_dims=None, is_dataset_splitted=False,
                     dense_tensor_idx=None):
    """Paddle's `dist.shard_dataloader`: each rank gets its part (along mesh dim `shard_dims`, e.g. "dp") of
    every global batch `dataloader` yields; `shard_dims=None` or `is_dataset_splitted=True` leaves batches
    whole (the loader already yields this rank's). Batches are tensors, or dicts/lists/tuples of them."""
    if is_dataset_splitted and shard_dims is None:
        raise ValueError("shard_dims must be set when is_dataset_splitted is True")
    if dense_tensor_idx is not None:
        raise ValueError("dense_tensor_idx is not needed with paddle_cp (every input is a local tensor): drop it")
    flat = _flat_meshes(meshes)
    if not flat:
        raise ValueError("shard_dataloader needs meshes: the ProcessMesh (or one per input) the batches go to")
    if input_keys is not None and len(flat) > 1 and len(input_keys) != len(flat):
        raise ValueError(f"input_keys {list(input_keys)} must name one key per mesh ({len(flat)} meshes)")
    dim = _one_shard_dim(shard_dims, len(meshes) if isinstance(meshes, (list, tuple)) else 1)
    if dim is None or is_dataset_splitted:
        return ShardDataloader(dataloader, 0, 1, input_keys)
    rank = dist.get_rank()
    mine = [mesh for mesh in flat if rank in mesh.process_ids]
    # a rank in none of the meshes (a middle pipeline stage) still takes the samples of its dp coordinate
    mesh = mine[0] if mine else mesh_lib.resolve_mesh(None)
    return ShardDataloader(dataloader, *_position(mesh, dim), input_keys)
