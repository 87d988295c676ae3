"""How each parameter is split and where it lives: one `ParamRecord` per parameter.

Tensor parallelism, sharding, the optimizer and `full_state_dict` read and write
only this record. `local_boxes` turns it into the pieces of the global tensor this
rank holds, in the terms of Paddle's `ShardedWeight(key, local_tensor, local_shape,
global_shape, global_offset)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from .mesh import MeshGroup

_ATTR = "_pcp_record"


@dataclass
class ParamRecord:
    """One per parameter, attached to the parameter object (`record_of(p)`)."""

    full_shape: tuple                     # the single-card shape
    tp_axis: Optional[int] = None         # axis split over mp (None: replicated over mp)
    tp_parts: tuple = ()                  # fused parts along tp_axis (q|k|v, gate|up); () = one part
    mp_group: Optional[MeshGroup] = None
    dp_group: Optional[MeshGroup] = None
    dp_owner: Optional[int] = None        # owner position in dp_group (sharding levels 1-3); None = every dp rank
    level: int = 0                        # sharding level
    mp_partial: bool = False              # gradient partial over mp, summed there (used on a split sequence;
                                          # a LoRA factor beside a split weight)
    stage: Optional[int] = None           # pipeline stage (the first holding it)
    pp_stages: tuple = ()                 # pipeline: every stage holding it (tied embeddings: first and last)
    pp_group: Optional[MeshGroup] = None  # pipeline: this rank's line of stages

    def __setattr__(self, name, value):
        # a misspelt field would silently become a new attribute nobody reads (slots=True needs Python 3.10)
        if name not in self.__dataclass_fields__:
            raise AttributeError(f"ParamRecord has no field {name!r}")
        object.__setattr__(self, name, value)

    @property
    def parts(self):
        """Sizes of the fused parts along tp_axis (one part when not fused)."""
        return self.tp_parts or (self.full_shape[self.tp_axis],)

    def tp_shape(self):
        """The shape of this rank's tensor-parallel slice: what dp level 3 fetches whole."""
        if self.tp_axis is None:
            return tuple(self.full_shape)
        shape = list(self.full_shape)
        shape[self.tp_axis] //= self.mp_group.size
        return tuple(shape)

    def owned_here(self):
        """Whether this rank keeps the optimizer state (and at level 3 the value) of the parameter."""
        return self.dp_owner is None or self.dp_owner == self.dp_group.index

    def on_this_stage(self):
        """Whether this rank's pipeline stage uses the parameter (always, without a pipeline)."""
        return self.pp_group is None or self.pp_group.index in self.pp_stages

    def holds_value(self):
        """Whether this rank's local tensor holds its tensor-parallel slice (level 3 keeps it on the owner only;
        a pipeline stage only the parameters it uses)."""
        return self.on_this_stage() and (self.level < 3 or self.owned_here())

    # tensor-parallel slicing: rank i of mp keeps piece i of every fused part -------------------

    def local(self, full):
        """This rank's slice of the full numpy array."""
        pieces = np.split(full, np.cumsum(self.parts)[:-1], axis=self.tp_axis)
        return np.concatenate([np.split(p, self.mp_group.size, axis=self.tp_axis)[self.mp_group.index]
                               for p in pieces], axis=self.tp_axis)

    def assemble(self, shards):
        """The full array from every mp rank's slice (mesh order)."""
        size = self.mp_group.size
        per_rank = [np.split(s, np.cumsum([p // size for p in self.parts])[:-1], axis=self.tp_axis) for s in shards]
        return np.concatenate([np.concatenate([r[k] for r in per_rank], axis=self.tp_axis)
                               for k in range(len(self.parts))], axis=self.tp_axis)

    def column_order(self):
        """Index that puts an all-gathered (rank-major) fused output back in part order."""
        n, sizes = self.mp_group.size, [p // self.mp_group.size for p in self.parts]
        rank_major = np.arange(sum(self.parts)).reshape(n, -1)
        offsets = np.cumsum([0] + sizes)
        return np.concatenate([rank_major[:, offsets[k]:offsets[k + 1]].reshape(-1) for k in range(len(sizes))])


class Box(NamedTuple):
    """A block of the global tensor held by this rank: where it sits globally, its shape, and
    where it sits in this rank's local tensor."""

    global_offset: tuple
    local_shape: tuple
    local_slice: tuple  # of slices into the local tensor


def record_of(param):
    """The parameter's record, created (replicated, unsharded) on first use."""
    record = getattr(param, _ATTR, None)
    if record is None:
        record = ParamRecord(full_shape=tuple(param.shape))
        setattr(param, _ATTR, record)
    return record


def share_record(source, target):
    """Let `target` (a tensor standing in for `source`, e.g. a fetched full copy) use the same record."""
    setattr(target, _ATTR, record_of(source))


def find_record(tensor):
    """The tensor's record, or None (buffers and plain tensors have none)."""
    return getattr(tensor, _ATTR, None)


def local_boxes(param):
    """How this rank's local tensor maps onto boxes of the global tensor: one box, or one per
    fused part of a tensor-parallel slice; empty when this rank holds nothing (level 3, not owner)."""
    record = record_of(param)
    if not record.holds_value():
        return []
    full = tuple(record.full_shape)
    whole = tuple(slice(0, d) for d in full)
    if record.tp_axis is None:
        return [Box((0,) * len(full), full, whole)]
    axis, size, index = record.tp_axis, record.mp_group.size, record.mp_group.index
    boxes, global_start, local_start = [], 0, 0
    for part in record.parts:
        piece = part // size
        offset = [0] * len(full)
        offset[axis] = global_start + index * piece
        shape = list(full)
        shape[axis] = piece
        local_slice = list(whole)
        local_slice[axis] = slice(local_start, local_start + piece)
        boxes.append(Box(tuple(offset), tuple(shape), tuple(local_slice)))
        global_start += part
        local_start += piece
    return boxes


def set_local_value(param, array):
    """Give `param` a new value of any shape, in place: optimizers and tied layers hold this object."""
    import paddle

    if param._is_initialized():
        place = param.place
        place = paddle.CUDAPlace(place.gpu_device_id()) if place.is_gpu_place() else paddle.CPUPlace()
        param._clear_data()  # else `set` reuses the old allocation when it is big enough: a slice would keep it all
    else:  # a lazy parameter has no place yet: it gets the one its initializer would have used
        place = paddle.framework._current_expected_place()
    param.get_tensor().set(np.ascontiguousarray(array), place)


def is_lazy(param):
    """Whether `param` was built under paddle.LazyGuard() and has not been initialized yet."""
    return getattr(param, "_init_func", None) is not None and not param._is_initialized()


def set_lazy_shape(param, shape):
    """Record the shape a lazy parameter will have here, without allocating it."""
    param.get_tensor()._set_dims(list(shape))


def local_part(param, full):
    """This rank's local tensor (a new one) cut from `full`, a paddle Tensor of the full shape; None
    where this rank holds no value. The pieces are `local_boxes`', so fused parts are cut per part."""
    import paddle

    boxes = local_boxes(param)
    if not boxes:
        return None
    if len(boxes) == 1 and boxes[0].local_shape == tuple(full.shape):
        return full
    pieces = [_copied(full[tuple(slice(o, o + n) for o, n in zip(box.global_offset, box.local_shape))])
              for box in boxes]
    return pieces[0] if len(pieces) == 1 else paddle.concat(pieces, axis=record_of(param).tp_axis)


def _copied(view):
    """A new tensor with the values of `view` (a view into another tensor, which may then be freed), in one
    copy: `contiguous()` copies a strided view once (`clone()` would copy it twice) but returns a contiguous one
    itself."""
    return view.clone() if view.is_contiguous() else view.contiguous()


def store_local_value(param, local):
    """Give `param` its value on this rank, lazy or not: `local` is this rank's local tensor (a paddle
    Tensor or numpy array laid out as `local_boxes` says; ignored where this rank holds no value).
    A level-3 non-owner gets the empty placeholder, another pipeline stage's parameter stays freed.
    A lazy parameter counts as initialized afterwards (no random draw), as after `p.initialize()`:
    this is how a loader (load_pretrained) fills a lazily built, parallelized model."""
    import paddle

    record = record_of(param)
    if record.holds_value():
        if isinstance(local, paddle.Tensor):
            local._share_underline_tensor_to(param)
        else:
            set_local_value(param, local)
    elif record.on_this_stage():
        _placeholder(param)
    elif param._is_initialized():
        param._clear_data()
        set_lazy_shape(param, record.tp_shape())  # what an eagerly built parameter freed there keeps
    param._init_func = None


def release_value(param):
    """Level 3, not the owner: an empty placeholder instead of the value (a lazy parameter gets it
    when it is initialized: until then it has none)."""
    if is_lazy(param):
        set_lazy_shape(param, [0])
    else:
        _placeholder(param)


def _placeholder(param):
    import paddle

    paddle.zeros([0], param.dtype)._share_underline_tensor_to(param)


def shard_parameter(param, axis, group, parts=None):
    """Keep this rank's tensor-parallel slice of `param` in place (the optimizer holds the same
    object) and record the split. The first plan that shards a parameter wins (a tied weight
    keeps its first split)."""
    record = record_of(param)
    if record.tp_axis is not None:
        if record.tp_axis != axis:
            raise ValueError(f"parameter {param.name} is shared by layers that split it on different axes "
                             f"({record.tp_axis} and {axis}): untie it or plan both layers alike")
        return record
    parts = tuple(parts or ())
    for part in parts or (param.shape[axis],):
        if part % group.size:
            raise ValueError(f"cannot split dim {axis} of {param.name} (part of size {part}) over {group.size} "
                             "mp ranks: choose an mp degree that divides it")
    record.tp_axis, record.tp_parts, record.mp_group = axis, parts, group
    if is_lazy(param):  # cut when it is initialized (lazy_init.py)
        set_lazy_shape(param, record.tp_shape())
    else:
        set_local_value(param, record.local(param.numpy()))
    return record
