"""The optimizer `parallelize` returns: reduces gradients over the right groups, clips, steps.

Rule: every rank takes the mean loss over its own tokens; gradients of
parameters replicated over `dp` and `sep` are averaged over those ranks, so with
equal token counts per rank this reproduces one card on the global batch.
Parameters used while the sequence is split over `mp` (sequence parallelism)
saw only this rank's tokens, and a LoRA factor beside a split weight only this
rank's slice of it: their gradients are summed over `mp` first. Frozen parameters
(no gradient on any rank) are skipped.
`ClipGradByGlobalNorm` clips by the norm over all shards, every gradient
counted once (tensor-parallel slices on each `mp` rank, replicated ones on one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import paddle

from ..comm import collectives
from ..mesh import MeshGroup
from ..params import record_of


def _coalesced(tensors):
    """One flat buffer per dtype: a handful of all-reduces instead of one per parameter."""
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    return by_dtype.values()


def _agree_on_gradients(parameters, mesh_group):
    """Give a zero gradient to every parameter that has one on some rank of the group but not here
    (a branch only some ranks took), so all ranks reduce buffers of one size, as one card would."""
    present = paddle.to_tensor([int(p.grad is not None) for p in parameters], dtype="int32")
    collectives.all_reduce(mesh_group, present, tag="grad_presence")
    for param, count in zip(parameters, present.numpy().tolist()):
        if count and param.grad is None:
            param._set_grad_ivar(paddle.zeros(param.shape, param.dtype))


def _reduce_gradients(parameters, mesh_group, tag, average):
    parameters = [p for p in parameters if not p.stop_gradient]  # frozen: no gradient on any rank
    if mesh_group.size == 1 or not parameters:
        return
    _agree_on_gradients(parameters, mesh_group)
    # dropped gradients (another dp rank owns them) are empty: nothing to reduce
    # sizes from shapes: int(numel()) would read a device tensor, a host sync per parameter per step
    grads = [p.grad for p in parameters if p.grad is not None and p.grad._is_initialized() and math.prod(p.grad.shape)]
    for same_dtype in _coalesced(grads):
        flat = paddle.concat([g.reshape([-1]) for g in same_dtype])
        collectives.all_reduce(mesh_group, flat, tag=tag)
        if average:
            flat = flat / mesh_group.size
        for grad, part in zip(same_dtype, paddle.split(flat, [math.prod(g.shape) for g in same_dtype])):
            paddle.assign(part.reshape(grad.shape), grad)


def average_gradients(parameters, mesh_group):
    _reduce_gradients(parameters, mesh_group, "grad_all_reduce", average=True)


def optimizer_parameters(optimizer):
    """The optimizer's parameters, flattening parameter groups."""
    if getattr(optimizer, "_param_groups", None) and isinstance(optimizer._param_groups[0], dict):
        return [p for group in optimizer._param_groups for p in group["params"]]
    return list(optimizer._parameter_list)


@dataclass(frozen=True)
class GradientGroups:
    """The mesh slices gradients are reduced over. `replicas` is dp x sep; `world` the whole mesh."""

    replicas: MeshGroup
    dp: MeshGroup
    sep: MeshGroup
    mp: MeshGroup
    world: MeshGroup


class ParallelOptimizer:
    """Wraps a Paddle optimizer; everything but `step`/`minimize` goes to it unchanged,
    so parameter groups keep their own learning rate and weight decay."""

    def __init__(self, optimizer, groups, sharding=None, shared=None):
        self._inner = optimizer
        self._groups = groups
        self._sharding = sharding
        self._shared = shared  # pipeline: gradients of parameters held by several stages
        self._params = optimizer_parameters(optimizer)

    @property
    def inner(self):
        return self._inner

    def step(self):
        self._reduce_gradients()
        clips = self._clip_groups()
        self._clip_by_global_norm(clips)
        if self._sharding is not None:
            self._sharding.drop_foreign_gradients()
        try:
            for holder, key, _, _ in clips:
                holder[key] = None  # clipped already, with the norm over all shards
            self._inner.step()
        finally:
            for holder, key, clip, _ in clips:
                holder[key] = clip
        if self._sharding is not None:
            self._sharding.sync_parameters()

    def _reduce_gradients(self):
        """Sums over ranks commute: at sharding levels 2-3 reduce-scatter over dp first, so
        the mp and sep reductions after it only touch the gradients this rank owns."""
        groups, sharding = self._groups, self._sharding
        if self._shared is not None:
            self._shared.reduce()
        scattered = sharding is not None and sharding.level >= 2
        if scattered:
            sharding.reduce_scatter_gradients()
        partial = [p for p in self._params if record_of(p).mp_partial]
        _reduce_gradients(partial, groups.mp, "grad_mp_partial_all_reduce", average=False)
        average_gradients(self._params, groups.sep if scattered else groups.replicas)

    def _counted_here(self, param):
        """Whether this rank adds `param`'s gradient to the global norm (exactly one rank per copy)."""
        groups = self._groups
        record = record_of(param)
        if record.pp_group is not None and record.pp_group.index != record.stage:
            return False  # pipeline: held by several stages (tied embeddings), counted on its first
        if record.tp_axis is None and groups.mp.index != 0:
            return False
        if self._sharding is not None:
            return self._sharding.owns(param) and groups.sep.index == 0
        return groups.replicas.index == 0

    def _clip_groups(self):
        """(holder, key, clip, params) for every ClipGradByGlobalNorm the inner optimizer would apply.
        Paddle clips each parameter group by its own norm (its `grad_clip`), so do we."""
        inner = self._inner
        groups = inner._param_groups if getattr(inner, "_param_groups", None) and isinstance(
            inner._param_groups[0], dict) else None
        if groups is None:
            pairs = [(_AttrHolder(inner), "_grad_clip", inner._grad_clip, self._params)]
        else:
            pairs = [(group, "grad_clip", group.get("grad_clip"), group["params"]) for group in groups]
        return [pair for pair in pairs if isinstance(pair[2], paddle.nn.ClipGradByGlobalNorm)]

    def _clip_by_global_norm(self, clips):
        if not clips:
            return
        squares = []
        for _, _, _, params in clips:
            counted = [paddle.sum(paddle.square(p.grad.astype("float32"))) for p in params
                       if p.grad is not None and getattr(p, "need_clip", True) and self._counted_here(p)]
            squares.append(paddle.stack(counted).sum() if counted else paddle.zeros([], "float32"))
        totals = collectives.all_reduce(self._groups.world, paddle.stack(squares), tag="grad_norm_all_reduce")
        for (_, _, clip, params), total in zip(clips, paddle.sqrt(totals)):
            max_norm = paddle.full([], clip.clip_norm, "float32")
            scale = max_norm / paddle.maximum(total, max_norm)
            for p in params:
                if p.grad is not None and getattr(p, "need_clip", True):
                    paddle.assign(p.grad * scale.astype(p.grad.dtype), p.grad)

    def minimize(self, loss, startup_program=None, parameters=None, no_grad_set=None):
        loss.backward()
        self.step()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _AttrHolder:
    """Lets an optimizer attribute be read and set like a parameter group's dict entry."""

    def __init__(self, obj):
        self._obj = obj

    def __getitem__(self, key):
        return getattr(self._obj, key)

    def __setitem__(self, key, value):
        setattr(self._obj, key, value)
