"""The files: Paddle's flex-checkpoint format (`dist.save_state_dict` of `dist.ShardedWeight` boxes)
under PaddleFormers' key names, read back box by box without Paddle's loader (it calls `.cuda()`).

Boxes: whatever layout saved it, each tensor is written as contiguous blocks of rows (axis 0),
block r by world rank r (rows spread as evenly as they go; a tensor with fewer rows than ranks
is written by its first ranks). So a fused q|k|v shard, a dp-owned parameter or a level-3
placeholder all become one plain box per rank, every element written once, the write load
even across ranks, and `dist.load_merged_state_dict` merges the result in one process.
"""
from __future__ import annotations

import os
import pickle

import numpy as np
import paddle
import paddle.distributed as dist

MODEL_DIR, OPTIMIZER_DIR = "model_state", "optimizer_state"


def optimizer_key(param_key, accumulator):
    """PaddleFormers' optimizer key: `{param}.moment1_0`, `{param}.beta1_pow_acc_0`, ..."""
    return f"{param_key}.{accumulator}_0"


def row_box(shape, world, rank):
    """(global_offset, local_shape) of the rows rank `rank` writes, or None when it writes none."""
    if len(shape) == 0:
        return ((), ()) if rank == 0 else None
    start, stop = _row_range(shape[0], world, rank)
    if start == stop:
        return None
    return (start,) + (0,) * (len(shape) - 1), (stop - start,) + tuple(shape[1:])


def _row_range(rows, world, rank):
    base, extra = divmod(rows, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def sharded_weights(full_values, world, rank):
    """{key: ShardedWeight} of this rank's row boxes of full numpy arrays."""
    boxes = {}
    for key, value in full_values.items():
        box = row_box(value.shape, world, rank)
        if box is None:
            continue
        offset, local_shape = box
        local = value[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]
        boxes[key] = dist.ShardedWeight(key=key, local_tensor=paddle.to_tensor(np.ascontiguousarray(local)),
                                        local_shape=local_shape, global_shape=tuple(value.shape),
                                        global_offset=offset)
    return boxes


def read_metadata(directory):
    """Paddle's Metadata of one state directory (`{uid}.metadata`, the newest uid)."""
    names = sorted(f for f in os.listdir(directory) if f.endswith(".metadata"))
    if not names:
        raise ValueError(f"checkpoint directory {directory} has no .metadata file: it is not a complete "
                         "checkpoint (pass a path that pcp.latest_checkpoint returns)")
    path = os.path.join(directory, names[-1])
    try:
        return paddle.load(path)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise ValueError(f"checkpoint file {path} is unreadable ({type(exc).__name__}: {exc}): "
                         "the checkpoint is damaged; load an earlier one") from exc


def global_specs(metadata):
    """{key: (global_shape, dtype)} of every tensor a Metadata describes."""
    return {key: global_spec(metadata, key) for key in metadata.state_dict_metadata}


class BoxReader:
    """Full numpy values of keys of one state directory, reading each data file at most once."""

    def __init__(self, directory, metadata):
        self.directory, self.metadata = directory, metadata
        self._files = {}

    def _file(self, name):
        if name not in self._files:
            path = os.path.join(self.directory, name)
            try:
                self._files[name] = paddle.load(path, return_numpy=True)
            except (OSError, EOFError, pickle.UnpicklingError, ValueError, RuntimeError) as exc:
                raise ValueError(f"checkpoint file {path} is unreadable ({type(exc).__name__}: {exc}): "
                                 "the checkpoint is damaged; load an earlier one") from exc
        return self._files[name]

    def full(self, key):
        shape, dtype = global_spec(self.metadata, key)
        out = np.empty(shape, dtype=_numpy_dtype(dtype))
        covered = 0
        for index, name in self.metadata.storage_metadata.items():
            if index.tensor_key != key:
                continue
            block = np.asarray(self._file(name)[key])
            region = tuple(slice(o, o + n) for o, n in zip(index.global_offset, block.shape))
            out[region] = block
            covered += block.size
        if covered != out.size:
            raise ValueError(f"checkpoint {self.directory} holds {covered} of the {out.size} elements of "
                             f"'{key}': files are missing; load an earlier checkpoint")
        return out


def global_spec(metadata, key):
    box = metadata.state_dict_metadata[key][0]
    return tuple(box.global_shape), str(box.dtype)


def _numpy_dtype(dtype):
    name = dtype.replace("paddle.", "")
    return np.dtype("uint16") if name == "bfloat16" else np.dtype(name)
