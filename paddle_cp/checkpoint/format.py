"""The files: Paddle's flex-checkpoint format under PaddleFormers' key names, as
`dist.save_state_dict` writes it (`0.metadata`: a pickled `Metadata` of every box;
`{n}_0.distcp`: pickled dicts of boxes) and `dist.load_merged_state_dict` reads it; read back
here box by box, without Paddle's loader (it calls `.cuda()`).

Boxes: each rank writes the pieces of the global tensors it holds (`shards.py` picks one holder
of each piece), so saving moves no data between ranks. A data file holds at most one box per
key, so a rank holding several pieces of one key (the q|k|v parts of a fused projection) writes
them to several files, `{rank + slot * world}_0.distcp` (slot 0 always written), and no file holds
more than the largest box: `paddle.save` keeps a file's worth of copies while it pickles. Beside each data
file, `{file}.index.json` says where every box's bytes start in it (the pickle stores an array's
bytes raw), so a loader reads just the byte ranges of the boxes it needs; the coordinator builds
`0.metadata` from these indexes once every rank has written (writing needs no collective, which
lets a background thread do it).
"""
from __future__ import annotations

import json
import os
import pickle
import pickletools

import numpy as np
import paddle
from paddle.distributed.flex_checkpoint.dcp.metadata import LocalTensorIndex, LocalTensorMetadata, Metadata

from .io_bytes import count

MODEL_DIR, OPTIMIZER_DIR = "model_state", "optimizer_state"
METADATA_FILE = "0.metadata"
INDEX_SUFFIX = ".index.json"


def data_file(rank, slot=0, world=1):
    return f"{rank + slot * world}_0.distcp"


def optimizer_key(param_key, accumulator):
    """PaddleFormers' optimizer key: `{param}.moment1_0`, `{param}.beta1_pow_acc_0`, ..."""
    return f"{param_key}.{accumulator}_0"


def _data_offsets(path, sizes):
    """{key: offset of its array's bytes} in a file paddle.save wrote: each array's raw bytes follow its
    key (a pickle string) as the first bytes opcode of that size."""
    offsets, pending = {}, None
    with open(path, "rb") as f:
        for op, arg, pos in pickletools.genops(f):
            if isinstance(arg, str) and arg in sizes and arg not in offsets:
                pending = arg
            elif op.name in _BYTES_OPS and pending is not None and len(arg) == sizes[pending]:
                offsets[pending], pending = pos + 1 + _BYTES_OPS[op.name], None
    return offsets


_BYTES_OPS = {"SHORT_BINBYTES": 1, "BINBYTES": 4, "BINBYTES8": 8}  # opcode -> length field size


def write_state(directory, files, copied):
    """This rank's data files {name: {key: SavedBox}} and their indexes, one file's boxes on the host at a time
    (all of them already when `copied`)."""
    os.makedirs(directory, exist_ok=True)
    for name, boxes in files.items():
        path = os.path.join(directory, name)
        paddle.save({key: box.take(copied) for key, box in boxes.items()}, path)
        for box in boxes.values():
            box.value = None  # this file's host copies go before the next file's are taken
        sizes = {key: box.nbytes for key, box in boxes.items()}
        offsets = _data_offsets(path, sizes)
        if set(offsets) != set(sizes):
            raise RuntimeError(f"checkpoint file {path}: no data found for {sorted(set(sizes) - set(offsets))[:3]}")
        index = {key: {"global_offset": list(box.global_offset), "local_shape": list(box.local_shape),
                       "global_shape": list(box.global_shape), "dtype": box.dtype, "byte_offset": offsets[key]}
                 for key, box in boxes.items()}
        with open(path + INDEX_SUFFIX, "w") as f:
            json.dump(index, f)
        count("written", sum(sizes.values()))


def merge_metadata(directory):
    """Paddle's Metadata of every box the ranks wrote into `directory`, from their indexes (coordinator)."""
    boxes, storage, specs = {}, {}, {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(INDEX_SUFFIX):
            continue
        with open(os.path.join(directory, name)) as f:
            index = json.load(f)
        for key, box in sorted(index.items()):
            offset, shape = tuple(box["global_offset"]), tuple(box["local_shape"])
            boxes.setdefault(key, []).append(LocalTensorMetadata(offset, shape, box["dtype"], tuple(box["global_shape"])))
            storage[LocalTensorIndex(tensor_key=key, global_offset=offset, local_shape=shape)] = \
                name[:-len(INDEX_SUFFIX)]
            specs[key] = None
    meta = Metadata(state_dict_metadata=boxes, storage_metadata=storage, flat_mapping={key: (key,) for key in specs})
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
    """Regions of the global tensors of one state directory, reading only the bytes of the boxes that
    overlap them (a whole data file only when it has no index: files written by other tools)."""

    def __init__(self, directory, metadata):
        self.directory, self.metadata = directory, metadata
        self._indexes, self._files = {}, {}
        self._boxes = {}  # key -> [(global_offset, local_shape, data file)]
        for index, name in metadata.storage_metadata.items():
            self._boxes.setdefault(index.tensor_key, []).append((index.global_offset, index.local_shape, name))

    def _index(self, name):
        if name not in self._indexes:
            path = os.path.join(self.directory, name + INDEX_SUFFIX)
            self._indexes[name] = None
            if os.path.isfile(path):
                with open(path) as f:
                    self._indexes[name] = json.load(f)
        return self._indexes[name]

    def _whole_file(self, name):
        if name not in self._files:
            path = os.path.join(self.directory, name)
            try:
                self._files[name] = paddle.load(path, return_numpy=True)
            except (OSError, EOFError, pickle.UnpicklingError, ValueError, RuntimeError) as exc:
                raise ValueError(f"checkpoint file {path} is unreadable ({type(exc).__name__}: {exc}): "
                                 "the checkpoint is damaged; load an earlier one") from exc
            count("read", os.path.getsize(path))
        return self._files[name]

    def _read(self, key, name, shape, dtype, inner):
        """`inner` (slices into the stored box) of the box of `key` in data file `name`."""
        index = self._index(name)
        if index is None:
            return np.asarray(self._whole_file(name)[key])[inner]
        stored = np.memmap(os.path.join(self.directory, name), dtype=dtype, mode="r",
                           offset=index[key]["byte_offset"], shape=tuple(shape))
        block = np.array(stored[inner])  # reads only the pages of the region
        del stored
        count("read", block.nbytes)
        return block

    def region(self, key, offset, shape):
        """The values of `key` in the global box at `offset` of size `shape` (numpy)."""
        dtype = numpy_dtype(global_spec(self.metadata, key)[1])
        out = np.empty(tuple(shape), dtype=dtype)
        covered = 0
        for box_offset, box_shape, name in self._boxes.get(key, []):
            lo = [max(o, b) for o, b in zip(offset, box_offset)]
            hi = [min(o + n, b + m) for o, n, b, m in zip(offset, shape, box_offset, box_shape)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            inner = tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, box_offset))
            block = self._read(key, name, box_shape, dtype, inner)
            out[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offset))] = block
            covered += block.size
        if covered != out.size:
            raise ValueError(f"checkpoint {self.directory} holds {covered} of the {out.size} elements this rank "
                             f"needs of '{key}': files are missing; load an earlier checkpoint")
        return out

    def full(self, key):
        shape = global_spec(self.metadata, key)[0]
        return self.region(key, (0,) * len(shape), shape)


def numpy_dtype(dtype):
    """numpy's dtype for a Paddle dtype name (bfloat16: its uint16 bits)."""
    name = dtype.replace("paddle.", "")
    return np.dtype("uint16") if name == "bfloat16" else np.dtype(name)
