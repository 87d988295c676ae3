"""The files: Paddle's flex-checkpoint format under PaddleFormers' key names, as
`dist.save_state_dict` writes it (`0.metadata`: a pickled `Metadata` of every box;
`{rank}_0.distcp`: each rank's boxes) and `dist.load_merged_state_dict` reads it;
read back here box by box, without Paddle's loader (it calls `.cuda()`).

Boxes: whatever layout saved it, each tensor is written as contiguous blocks of rows (axis 0),
block r by world rank r (rows spread as evenly as they go; a tensor with fewer rows than ranks
is written by its first ranks). So a fused q|k|v shard, a dp-owned parameter or a level-3
placeholder all become one plain box per rank, every element written once, the write load
even across ranks. As every rank knows every box, the metadata needs no exchange: writing
issues no collective, which lets a background thread do it (`dist.save_state_dict` exchanges
metadata with collectives and its async path calls `paddle.device.synchronize`, which fails on CPU).
"""
from __future__ import annotations

import os
import pickle

import numpy as np
import paddle
from paddle.distributed.flex_checkpoint.dcp.metadata import LocalTensorIndex, LocalTensorMetadata, Metadata

MODEL_DIR, OPTIMIZER_DIR = "model_state", "optimizer_state"
METADATA_FILE = "0.metadata"


def data_file(rank):
    return f"{rank}_0.distcp"


def optimizer_key(param_key, accumulator):
    """PaddleFormers' optimizer key: `{param}.moment1_0`, `{param}.beta1_pow_acc_0`, ..."""
    return f"{param_key}.{accumulator}_0"


def row_box(shape, world, rank):
    """(global_offset, local_shape) of the rows rank `rank` writes, or None when it writes none."""
    if len(shape) == 0:
        return ((), ()) if rank == 0 else None
    base, extra = divmod(shape[0], world)
    start = rank * base + min(rank, extra)
    rows = base + (rank < extra)
    if rows == 0:
        return None
    return (start,) + (0,) * (len(shape) - 1), (rows,) + tuple(shape[1:])


def local_boxes(values, world, rank):
    """This rank's row boxes of (key, full array) pairs, as Tensors (copies), and every key's
    (global shape, dtype): what `metadata` needs."""
    boxes, specs = {}, {}
    for key, value in values:
        specs[key] = (tuple(value.shape), value.dtype.name)
        box = row_box(value.shape, world, rank)
        if box is not None:
            offset, local_shape = box
            block = value[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]
            boxes[key] = paddle.to_tensor(np.ascontiguousarray(block), place=paddle.CPUPlace())
    return boxes, specs


def metadata(specs, world):
    """Paddle's Metadata of every rank's boxes of tensors {key: (global shape, dtype)}."""
    boxes, storage = {}, {}
    for key, (shape, dtype) in specs.items():
        boxes[key] = []
        for rank in range(world):
            box = row_box(shape, world, rank)
            if box is None:
                continue
            offset, local_shape = box
            boxes[key].append(LocalTensorMetadata(offset, local_shape, dtype, shape))
            storage[LocalTensorIndex(tensor_key=key, global_offset=offset, local_shape=local_shape)] = data_file(rank)
    return Metadata(state_dict_metadata=boxes, storage_metadata=storage, flat_mapping={key: (key,) for key in specs})


def write_state(directory, boxes, meta):
    """This rank's data file, and the metadata if `meta` is given (the coordinator's)."""
    os.makedirs(directory, exist_ok=True)
    paddle.save(boxes, os.path.join(directory, data_file(paddle.distributed.get_rank())))
    if meta is not None:
        paddle.save(meta, os.path.join(directory, METADATA_FILE))


def read_metadata(directory):
    """Paddle's Metadata of one state directory."""
    path = os.path.join(directory, METADATA_FILE)
    try:
        with open(path, "rb") as f:
            meta = pickle.load(f)  # what paddle.save wrote for a Python object; no C++ parser to trip
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise ValueError(f"checkpoint file {path} is unreadable ({type(exc).__name__}: {exc}): "
                         "the checkpoint is damaged; load an earlier one") from exc
    if not isinstance(meta, Metadata):
        raise ValueError(f"checkpoint file {path} holds a {type(meta).__name__}, not Paddle's checkpoint Metadata: "
                         "the checkpoint is damaged; load an earlier one")
    return meta


def global_spec(metadata, key):
    box = metadata.state_dict_metadata[key][0]
    return tuple(box.global_shape), str(box.dtype)


def global_specs(metadata):
    """{key: (global_shape, dtype)} of every tensor a Metadata describes."""
    return {key: global_spec(metadata, key) for key in metadata.state_dict_metadata}


class BoxReader:
    """Full numpy values of keys of one state directory, reading each data file at most once."""

    def __init__(self, directory, metadata):
        self.directory, self.metadata = directory, metadata
        self._files = {}
        self._boxes = {}  # key -> [(global_offset, data file)]
        for index, name in metadata.storage_metadata.items():
            self._boxes.setdefault(index.tensor_key, []).append((index.global_offset, name))

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
        for offset, name in self._boxes.get(key, []):
            block = np.asarray(self._file(name)[key])
            region = tuple(slice(o, o + n) for o, n in zip(offset, block.shape))
            out[region] = block
            covered += block.size
        if covered != out.size:
            raise ValueError(f"checkpoint {self.directory} holds {covered} of the {out.size} elements of "
                             f"'{key}': files are missing; load an earlier checkpoint")
        return out


def _numpy_dtype(dtype):
    name = dtype.replace("paddle.", "")
    return np.dtype("uint16") if name == "bfloat16" else np.dtype(name)
