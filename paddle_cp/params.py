"""Where each parameter lives: one `ParamRecord` per parameter, a list of placements (DTensor-style).

A placement says how the parameter is laid out over one MeshGroup: a mesh dim, several dims taken
together (the data replicas dp x sep), or a part of them (`mesh.fold_groups`: expert groups and the
ranks that hold the same experts). The kinds:

- `Shard(group, axis, parts)`: split along `axis`; each fused part (q|k|v, gate|up) is cut into
  group.size contiguous pieces whose sizes differ by at most one (the first positions get the extra);
- `Replicate(group)`: the same value and the same gradient on every position (mp outside a split
  sequence, a mesh dim no plan uses);
- `Partial(group, reduce)`: the same value; each position's gradient is a part of it, summed ("sum":
  a layer on a split sequence, a LoRA factor beside a split weight) or averaged ("avg": data replicas,
  every rank taking the mean loss over its own tokens);
- `Held(group, positions)`: only these positions hold it (a pipeline stage's parameters, tied
  embeddings on the first and last stage, one rank's experts); the gradient is summed over them;
- `Owned(...)`: data replicas (averaged as Partial "avg") sharded by owner (sharding levels 1-3): one
  position keeps the optimizer state, at level 3 the value too.

Every consumer asks the record, which asks each placement: `reductions()` (the groups a gradient is
summed or averaged over, and when), `chosen_here` (which rank counts a gradient in the global norm,
which rank writes a checkpoint piece), `local_boxes` (how a local tensor maps onto boxes of the global
tensor, in the terms of Paddle's `ShardedWeight(key, local_tensor, local_shape, global_shape,
global_offset)`), `held_here` / `holds_value` / `steps_here`, `value_sources` (where a full value is
fetched from). So a new parallelism is a plan that places its parameters (with these kinds, or a new
Placement subclass answering the same questions): the optimizer, sharding, checkpoints, full state,
pretrained load and export and lazy initialization follow without change.

`complete_placements` closes a record at parallelize: it accounts for every mesh dim no placement
names (the data dims dp and sep as one Partial "avg" group, any other as Replicate). A plan that
places a parameter over part of the data dims places the rest itself. Experts, for instance, with
`inner, outer = dims.fold(["dp", "sep"], E)` (mesh.ParallelDims): stacked experts [E, H, 2I] are
`shard_parameter(p, 0, inner, allow_uneven=True)` plus `Partial(outer, "avg")`; an expert of a
LayerList is `hold_parameter(p, inner, [its position])` plus `Partial(outer, "avg")`. Completion
then adds nothing over dp and sep; sharding levels shard over `outer` (its Partial "avg"), the
optimizer averages over it, and checkpoints, full state, export and lazy init cut and gather the
experts from the Shard or Held placement.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np
import paddle

from .mesh import MeshGroup, find_dim

_ATTR = "_pcp_record"
DATA_DIMS = ("dp", "sep")  # each rank of these feeds its own samples or tokens: gradients averaged


class Reduction(NamedTuple):
    """A step of making a gradient complete: summed or averaged over `group`, in `phase`."""

    phase: int  # BEFORE_SHARDING, SHARDING or AFTER_SHARDING
    group: MeshGroup
    op: str     # "sum" or "avg"


# The optimizer runs the phases in order, each phase's groups in one order on every rank.
BEFORE_SHARDING = 0  # the ranks of the group may own different parameters (pipeline stages)
SHARDING = 1         # the reduce-scatter onto owners (sharding levels 2-3)
AFTER_SHARDING = 2   # on what this rank owns


class Placement:
    """How a parameter is laid out over `group`. The defaults describe a replica."""

    group: MeshGroup

    def holds(self):
        """Whether this position has the parameter at all (its stage uses it, it is one of its experts)."""
        return True

    def keeps_value(self):
        """Whether this position keeps its value (not only a placeholder)."""
        return self.holds()

    def steps(self):
        """Whether this position's optimizer steps it (and keeps its state)."""
        return self.holds()

    def chosen(self, seed, split):
        """Whether this position is the one, picked by `seed` where several hold equal copies, that counts
        the gradient or writes the piece; `split`: the value is cut as the record says (a scalar accumulator
        of a split parameter is not)."""
        return self.group.index == seed % self.group.size

    def reductions(self):
        """[Reduction] that complete this position's gradient over the group."""
        return []

    def value_source(self):
        """(group, position) whose value positions without one receive for a full value, or None."""
        return None


@dataclass(frozen=True)
class Shard(Placement):
    group: MeshGroup
    axis: int
    parts: tuple  # lengths of the fused parts along axis (one part: the whole length)

    def pieces(self, position=None):
        """[(global start, length)] of the position's piece of each part."""
        position = self.group.index if position is None else position
        pieces, start = [], 0
        for part in self.parts:
            base, extra = divmod(part, self.group.size)
            pieces.append((start + position * base + min(position, extra), base + (position < extra)))
            start += part
        return pieces

    def local_length(self, position=None):
        return sum(length for _, length in self.pieces(position))

    def chosen(self, seed, split):
        return True if split else super().chosen(seed, split)

    def cut(self, full, position=None):
        """The position's local array from an array whole along `axis`."""
        before = (slice(None),) * self.axis
        return np.concatenate([full[before + (slice(start, start + length),)]
                               for start, length in self.pieces(position)], axis=self.axis)

    def put(self, whole, position, local):
        """Write the position's local array into `whole` (an array whole along `axis`)."""
        before, offset = (slice(None),) * self.axis, 0
        for start, length in self.pieces(position):  # one piece of each fused part
            whole[before + (slice(start, start + length),)] = local[before + (slice(offset, offset + length),)]
            offset += length

    def assemble(self, locals_):
        """The array whole along `axis` from every position's local array (mesh order)."""
        shape = list(locals_[0].shape)
        shape[self.axis] = sum(self.parts)
        whole = np.empty(shape, locals_[0].dtype)
        for position, local in enumerate(locals_):
            self.put(whole, position, local)
        return whole

    def column_order(self):
        """Index that puts the positions' local tensors concatenated along `axis` back in part order."""
        starts = np.cumsum([0] + [self.local_length(r) for r in range(self.group.size)])
        order = []
        for k in range(len(self.parts)):
            for r in range(self.group.size):
                offset = starts[r] + sum(n for _, n in self.pieces(r)[:k])
                order.extend(range(offset, offset + self.pieces(r)[k][1]))
        return np.asarray(order)


@dataclass(frozen=True)
class Replicate(Placement):
    group: MeshGroup


@dataclass(frozen=True)
class Partial(Placement):
    group: MeshGroup
    reduce: str  # "sum" or "avg"

    def reductions(self):
        return [Reduction(AFTER_SHARDING, self.group, self.reduce)]


@dataclass(frozen=True)
class Held(Placement):
    group: MeshGroup
    positions: tuple                   # the positions holding it, ascending
    holders: Optional[MeshGroup] = None  # this rank's group over those positions (where it is one of them)

    def holds(self):
        return self.group.index in self.positions

    def chosen(self, seed, split):
        return self.group.index == self.positions[0]

    def reductions(self):
        if self.holders is None or self.holders.size == 1 or not self.holds():
            return []
        return [Reduction(BEFORE_SHARDING, self.holders, "sum")]

    def value_source(self):
        return self.group, self.positions[0]


@dataclass(frozen=True)
class Owned(Placement):
    """Data replicas over `group`, sharded over `shard_group` (group's ranks along some of its dims): position
    `owner` there keeps the optimizer state (level 3: the value); `rest` is the rest of `group` (None when
    the sharding spans it all), over which the owners' gradients are still averaged."""

    group: MeshGroup
    shard_group: MeshGroup
    rest: Optional[MeshGroup]
    owner: int
    level: int

    def owner_here(self):
        return self.shard_group.index == self.owner

    def keeps_value(self):
        return self.level < 3 or self.owner_here()

    def steps(self):
        return self.owner_here()

    def chosen(self, seed, split):
        return self.owner_here() and (self.rest is None or self.rest.index == seed % self.rest.size)

    def reductions(self):
        if self.level == 1:  # every replica gets the average; the owner steps and sends the new value
            return [Reduction(AFTER_SHARDING, self.group, "avg")]
        rest = [] if self.rest is None else [Reduction(AFTER_SHARDING, self.rest, "avg")]
        return [Reduction(SHARDING, self.shard_group, "avg")] + rest

    def value_source(self):
        return (self.shard_group, self.owner) if self.level == 3 else None


class Box(NamedTuple):
    """A block of the global tensor held by this rank: where it sits globally, its shape, and
    where it sits in this rank's local tensor."""

    global_offset: tuple
    local_shape: tuple
    local_slice: tuple  # of slices into the local tensor


@dataclass
class ParamRecord:
    """One per parameter, attached to the parameter object (`record_of(p)`)."""

    full_shape: tuple                                 # the single-card shape
    placements: list = field(default_factory=list)   # in the order the plans placed them

    def __setattr__(self, name, value):
        # a misspelt field would silently become a new attribute nobody reads (slots=True needs Python 3.10)
        if name not in self.__dataclass_fields__:
            raise AttributeError(f"ParamRecord has no field {name!r}")
        object.__setattr__(self, name, value)

    def on(self, group):
        """The placement over `group`, or None."""
        return next((p for p in self.placements if p.group == group), None)

    def find(self, kind):
        """The placements of one kind (a Placement subclass)."""
        return [p for p in self.placements if isinstance(p, kind)]

    def place(self, placement):
        """Add a placement; it replaces a Replicate over the same group (a parameter found to have a partial
        gradient), any other placement there is a conflict."""
        old = self.on(placement.group)
        if old is not None and not isinstance(old, Replicate):
            raise ValueError(f"a {type(old).__name__} placement is over ranks {list(old.group.ranks)} already: "
                             f"cannot add {type(placement).__name__}")
        self.placements = [placement if p is old else p for p in self.placements] if old else \
            [*self.placements, placement]

    def replace(self, old, new):
        self.placements = [new if p is old else p for p in self.placements]

    def mark_partial(self, group):
        """This rank's gradient is a part of the parameter's over `group` (used on a split sequence): summed there."""
        old = self.on(group)
        if isinstance(old, Partial) and old.reduce == "sum":
            return
        if isinstance(old, Shard):
            raise ValueError(f"a parameter of shape {list(self.full_shape)} split over ranks {list(group.ranks)} "
                             "is used where the sequence is split over them too: keep sequence parallelism "
                             "(SequenceParallelBegin/End) around layers whose weights are whole")
        self.place(Partial(group, "sum"))

    # where it lives ---------------------------------------------------------------------------

    def held_here(self):
        """Whether this rank has the parameter at all (its pipeline stage uses it; it is one of its experts)."""
        return all(p.holds() for p in self.placements)

    def holds_value(self):
        """Whether this rank's local tensor holds its value (level 3 keeps it on the owner only; a pipeline
        stage only the parameters it uses)."""
        return all(p.keeps_value() for p in self.placements)

    def steps_here(self):
        """Whether this rank's optimizer steps the parameter (and keeps its state)."""
        return all(p.steps() for p in self.placements)

    def chosen_here(self, seed=0, split=True):
        """Whether this rank is the one among those holding equal copies of its piece that counts the gradient
        in the global norm (seed 0) or writes the piece (seed: a hash of the key, spreading the writing)."""
        return all(p.chosen(seed, split) for p in self.placements)

    def reductions(self):
        return [r for p in self.placements for r in p.reductions()]

    def value_sources(self):
        """[(group, position)] a full value is fetched from, in the order to fetch (the last placed first)."""
        return [s for s in (p.value_source() for p in reversed(self.placements)) if s is not None]

    # its local tensor --------------------------------------------------------------------------

    def shards(self):
        return self.find(Shard)

    def local_shape(self):
        """The shape of this rank's local tensor (what sharding level 3 fetches whole)."""
        shape = list(self.full_shape)
        for shard in self.shards():
            shape[shard.axis] = shard.local_length()
        return tuple(shape)

    def boxes(self):
        """The Boxes of this rank's local tensor (whether or not it holds its value now): one per piece
        of the product of its shards (one piece per fused part along each split axis)."""
        full = tuple(self.full_shape)
        along = {}  # axis -> [(global start, length, local start)]
        for shard in self.shards():
            if shard.axis in along:
                raise ValueError(f"a parameter of shape {list(full)} is split twice along axis {shard.axis}: "
                                 "split each axis over one group")
            local, pieces = 0, []
            for start, length in shard.pieces():
                pieces.append((start, length, local))
                local += length
            along[shard.axis] = pieces
        axes = sorted(along)
        boxes = []
        for combination in itertools.product(*(along[a] for a in axes)):
            offset, shape, local_slice = [0] * len(full), list(full), [slice(0, d) for d in full]
            for axis, (start, length, local) in zip(axes, combination):
                offset[axis], shape[axis], local_slice[axis] = start, length, slice(local, local + length)
            if all(shape):  # an uneven split may leave a position no piece of a part
                boxes.append(Box(tuple(offset), tuple(shape), tuple(local_slice)))
        return boxes

    def local(self, full):
        """This rank's local array cut from the full numpy array."""
        local = np.empty(self.local_shape(), dtype=full.dtype)
        for box in self.boxes():
            local[box.local_slice] = full[_window(box)]
        return local


def _window(box):
    return tuple(slice(o, o + n) for o, n in zip(box.global_offset, box.local_shape))


_FETCH_UNIT = "_pcp_fetch_unit"


def mark_fetch_unit(layer, runs_by_data=True):
    """Sharding level 3 fetches the parameters of `layer` and all its sublayers together, around its forward and
    backward, not around each sublayer's: for sublayers that run or not, and in an order, depending on the
    data (a rank's experts, `runs_by_data`), where per-sublayer fetches (collectives) would not meet on every
    rank; or that run a number of times set by the rank's rows (a tiled MLP: runs_by_data=False, its gradients
    still arrive at one point of backward on every rank, so buckets.py may reduce them during backward)."""
    object.__setattr__(layer, _FETCH_UNIT, "by_data" if runs_by_data else "whole")


def is_fetch_unit(layer, runs_by_data=False):
    """Whether `layer` is a fetch unit (with runs_by_data=True: one whose sublayers run by the data)."""
    mark = getattr(layer, _FETCH_UNIT, None)
    return mark == "by_data" if runs_by_data else mark is not None


def record_of(param):
    """The parameter's record, created (no placements: whole, everywhere) on first use."""
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


def complete_placements(param, dims):
    """Account for every mesh dim no placement of `param` names: the data dims (dp, sep) together as one
    Partial "avg" group (their ranks feed different tokens), every other dim as Replicate. The groups from
    `dims` (a mesh.ParallelDims; `placement_groups_needed` declares them)."""
    record = record_of(param)
    mesh = dims.mesh
    covered = {dim for p in record.placements for dim in p.group.dims}
    data = [find_dim(mesh, d) for d in DATA_DIMS if find_dim(mesh, d) not in (None, *covered)]
    if data:
        record.place(Partial(dims.group(tuple(data)), "avg"))
    for dim in mesh.dim_names:
        if dim not in covered and dim not in data:
            record.place(Replicate(dims.group((dim,))))
    return record


def placement_groups_needed(mesh):
    """The groups `complete_placements` places parameters over where no plan did (ParallelDims.build's needs):
    the data dims together, every other dim alone. A plan placing parameters over part of the data dims
    declares the rest itself."""
    data = (("group", "data"),) if any(find_dim(mesh, d) for d in DATA_DIMS) else ()
    data_names = {find_dim(mesh, d) for d in DATA_DIMS}
    return data + tuple(("group", (dim,)) for dim in mesh.dim_names if dim not in data_names)


def local_boxes(param):
    """How this rank's local tensor maps onto boxes of the global tensor: one box, or one per piece of
    its shards (fused parts cut per part); empty when this rank holds no value (level 3, not the owner;
    another pipeline stage's parameter)."""
    record = record_of(param)
    return record.boxes() if record.holds_value() else []


def set_local_value(param, array):
    """Give `param` a new value of any shape, in place: optimizers and tied layers hold this object."""
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
    boxes = local_boxes(param)
    if not boxes:
        return None
    if len(boxes) == 1 and boxes[0].local_shape == tuple(full.shape):
        return full
    if len(boxes) == 1:
        return _copied(full[_window(boxes[0])])
    local = paddle.empty(record_of(param).local_shape(), full.dtype)
    for box in boxes:
        local[box.local_slice] = full[_window(box)]
    return local


def _copied(view):
    """A new tensor with the values of `view` (a view into another tensor, which may then be freed), in one
    copy: `contiguous()` copies a strided view once (`clone()` would copy it twice) but returns a contiguous one
    itself."""
    return view.clone() if view.is_contiguous() else view.contiguous()


def store_local_value(param, local):
    """Give `param` its value on this rank, lazy or not: `local` is this rank's local tensor (a paddle
    Tensor or numpy array laid out as `local_boxes` says; ignored where this rank holds no value).
    A level-3 non-owner gets the empty placeholder, a parameter this rank does not hold stays freed.
    A lazy parameter counts as initialized afterwards (no random draw), as after `p.initialize()`:
    this is how a loader (load_pretrained) fills a lazily built, parallelized model."""
    record = record_of(param)
    if record.holds_value():
        if isinstance(local, paddle.Tensor):
            local._share_underline_tensor_to(param)
        else:
            set_local_value(param, local)
    elif record.held_here():
        _placeholder(param)
    elif param._is_initialized():
        param._clear_data()
        set_lazy_shape(param, record.local_shape())  # what an eagerly built parameter freed there keeps
    param._init_func = None


def release_value(param):
    """Level 3, not the owner: an empty placeholder instead of the value (a lazy parameter gets it
    when it is initialized: until then it has none)."""
    if is_lazy(param):
        set_lazy_shape(param, [0])
    else:
        _placeholder(param)


def _placeholder(param):
    paddle.zeros([0], param.dtype)._share_underline_tensor_to(param)


def shard_parameter(param, axis, group, parts=None, allow_uneven=False):
    """Keep this rank's piece of `param` along `axis` over `group` in place (the optimizer holds the same
    object) and place it: returns the Shard. `parts`: the lengths of fused parts, each cut separately.
    Pieces must be equal unless `allow_uneven` (then they differ by at most one). The first plan that
    shards a parameter over a group wins (a tied weight keeps its first split)."""
    record = record_of(param)
    old = record.on(group)
    if isinstance(old, Shard):
        if old.axis != axis:
            raise ValueError(f"parameter {param.name} is shared by layers that split it on different axes "
                             f"({old.axis} and {axis}): untie it or plan both layers alike")
        return old
    parts = tuple(parts or (record.full_shape[axis],))
    for part in parts if not allow_uneven else ():
        if part % group.size:
            raise ValueError(f"cannot split dim {axis} of {param.name} (part of size {part}) over {group.size} "
                             "ranks: choose a degree that divides it")
    shard = Shard(group, axis, parts)
    record.place(shard)
    if is_lazy(param):  # cut when it is initialized (lazy_init.py)
        set_lazy_shape(param, record.local_shape())
    else:
        set_local_value(param, shard.cut(param.numpy()))
    return shard


def hold_parameter(param, group, positions, holders=None):
    """Place `param` as held by `positions` of `group` only (see Held); where this rank is not one of them
    its value is freed (a lazy one has none yet: it keeps its shape, and gets no value when initialized)."""
    held = Held(group, tuple(sorted(positions)), holders)
    record_of(param).place(held)
    if not held.holds() and not is_lazy(param):
        param._clear_data()
    return held


def castable_placeholders(model):
    """Let Paddle cast `model` after parallelize (`paddle.amp.decorate(level="O2")`, `model.to(dtype=)`,
    `.bfloat16()`): a parameter whose value this rank does not hold (another pipeline stage's, another
    expert group's, a level-3 share owned elsewhere) has no data, and Paddle's cast of it raises "Tensor not
    initialized yet". Each layer holding one casts such a parameter as a placeholder: it takes the new dtype
    (as its holders' values do) and keeps its shape, still without data."""
    for layer in model.sublayers(include_self=True):
        if any(find_record(p) is not None and not find_record(p).holds_value() for p in layer._parameters.values()
               if p is not None):
            # an instance attribute: Layer._to_impl calls self._transform(t, device, dtype, blocking)
            layer.__dict__["_transform"] = _placeholder_transform(weakref.ref(layer), type(layer)._transform)


def _placeholder_transform(layer, transform):
    def cast(t, device, dtype, blocking):
        record = find_record(t)
        if t._is_initialized() or record is None or record.holds_value() or dtype is None:
            return transform(layer(), t, device, dtype, blocking)
        shape, empty = list(t.shape), paddle.empty([0], dtype)  # an empty tensor has the dtype and no data
        target, source = t.value(), empty.value()  # each Variable held while its tensor is used
        target.get_tensor()._share_data_nocheck_with(source.get_tensor())
        target.get_tensor()._set_dims(shape)
        return t
    return cast
