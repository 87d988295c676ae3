"""Which pieces of the global tensors this rank writes to a checkpoint: the boxes it holds
(`params.local_boxes`: its tensor-parallel pieces; nothing on a level-3 non-owner or another
pipeline stage), each written by exactly one of the ranks holding it, so no data moves between
ranks to save.

The writer of a piece is found from the record's placements alone, the same on every rank
(`ParamRecord.chosen_here`): the first pipeline stage holding it, the owner (sharding levels
1-3), and across the ranks that replicate it (dp at level 0, mp for an unsplit tensor, sep, any
other mesh dim) the position a hash of its key picks, which spreads the writing over the
replicas. A tensor without a record (a buffer) is written by the rank the hash picks.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import paddle
import paddle.distributed as dist

from ..params import Box, find_record, local_boxes
from . import layout
from .format import data_file, optimizer_key


@dataclass
class SavedBox:
    """A box this rank writes: `local_slice` of its local tensor `source`, taken to the host by `take()`."""

    global_offset: tuple
    local_shape: tuple
    global_shape: tuple
    dtype: str
    source: paddle.Tensor
    local_slice: tuple
    value: paddle.Tensor = None  # the host copy, once taken

    @property
    def nbytes(self):
        return math.prod(self.local_shape) * self.source.element_size()

    def take(self, copy):
        """The box's values on the host: a copy when `copy` (async: training goes on), else the
        tensor itself where the box is all of it."""
        if self.value is None:
            whole = tuple(self.local_shape) == tuple(self.source.shape)
            piece = (self.source if whole else self.source[self.local_slice]).cpu()
            self.value = piece.clone() if copy or not whole else piece
        return self.value


def writes_here(tensor, key, split):
    """Whether this rank writes its boxes of `tensor` (it must hold them); `split`: whether the value is
    cut as the record says (an accumulator of one number is not, even for a split parameter)."""
    record = find_record(tensor)
    seed = zlib.crc32(key.encode())
    if record is not None:
        return record.chosen_here(seed, split)
    world = layout.world_group()
    return world is None or world.index == seed % world.size


def _boxes(tensor, split):
    if split:
        return local_boxes(tensor)
    return [Box((0,) * len(tensor.shape), tuple(tensor.shape), tuple(slice(0, d) for d in tensor.shape))]


def _add(boxes, key, value, pieces, global_shape):
    boxes += [(key, SavedBox(tuple(box.global_offset), tuple(box.local_shape), tuple(global_shape),
                             layout.dtype_name(value.dtype), value, box.local_slice)) for box in pieces]


def files_of(boxes):
    """{data file: {key: SavedBox}}: at most one box per key per file (Paddle's files are dicts by key), each
    file at most the largest box's bytes (paddle.save holds a file's worth of copies while it pickles);
    slot 0 always present."""
    world, rank = dist.get_world_size(), dist.get_rank()
    limit = max((box.nbytes for _, box in boxes), default=0)
    files, sizes = [{}], [0]
    for key, box in boxes:
        slot = next((i for i, f in enumerate(files) if key not in f and sizes[i] + box.nbytes <= limit), None)
        if slot is None:
            files.append({})
            sizes.append(0)
            slot = len(files) - 1
        files[slot][key] = box
        sizes[slot] += box.nbytes
    return {data_file(rank, slot, world): f for slot, f in enumerate(files)}


def model_boxes(model):
    """[(key, SavedBox)] this rank writes of the model's state."""
    boxes = []
    for key, tensor in model.state_dict().items():
        split = find_record(tensor) is not None and bool(find_record(tensor).shards())
        if layout.holds_value(tensor) and writes_here(tensor, key, split):
            _add(boxes, key, tensor, _boxes(tensor, split), layout.global_shape(tensor))
    return boxes


def optimizer_boxes(model, optimizer):
    """[(`{param}.{state}_0`, SavedBox)] of the state this rank's optimizer holds: accumulators and, with
    multi_precision over float16/bfloat16 parameters, the fp32 master weight (`{param}.w_0`)."""
    first = layout.accumulator_names(optimizer)[0]
    boxes = []
    for key, param in model.named_parameters():
        if not layout.steps_here(param) or layout.state_tensor(optimizer, param, first) is None:
            continue  # not stepped here, or never stepped (no gradient yet): one card holds no state either
        record = find_record(param)
        for name in layout.state_names(optimizer, param):
            state_key = optimizer_key(key, name)
            split = record is not None and bool(record.shards()) and name not in layout.SCALAR_ACCUMULATORS
            if writes_here(param, state_key, split):
                value = layout.state_tensor(optimizer, param, name)
                shape = tuple(value.shape) if name in layout.SCALAR_ACCUMULATORS else layout.global_shape(param)
                _add(boxes, state_key, value, local_boxes(param) if split else _boxes(value, False), shape)
    return boxes
