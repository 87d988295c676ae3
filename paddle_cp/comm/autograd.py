"""Differentiable collectives: each forward's backward is its mirror image."""
from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from . import collectives


def _all_to_all(x, mesh_group, scatter_axis, gather_axis, scatter_sizes, gather_sizes, tag):
    chunks = paddle.split(x, scatter_sizes, axis=scatter_axis)
    recv_shapes = []
    for size in gather_sizes:
        shape = list(chunks[0].shape)
        shape[scatter_axis] = chunks[mesh_group.index].shape[scatter_axis]
        shape[gather_axis] = size
        recv_shapes.append(shape)
    received = collectives.all_to_all(mesh_group, chunks, tag=tag, recv_shapes=recv_shapes)
    return paddle.concat(received, axis=gather_axis)


class AllToAll(PyLayer):
    """Split dim `scatter_axis` over ranks and gather dim `gather_axis` from them.

    `scatter_sizes[j]`: how much of scatter_axis goes to position j;
    `gather_sizes[j]`: how much of gather_axis arrives from position j.
    """

    @staticmethod
    def forward(ctx, x, mesh_group, scatter_axis, gather_axis, scatter_sizes, gather_sizes, tag="all_to_all"):
        ctx.args = (mesh_group, gather_axis, scatter_axis, gather_sizes, scatter_sizes, tag)
        return _all_to_all(x, mesh_group, scatter_axis, gather_axis, scatter_sizes, gather_sizes, tag)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, *ctx.args)


def all_to_all(x, mesh_group, scatter_axis, gather_axis, scatter_sizes=None, gather_sizes=None, tag="all_to_all"):
    n = mesh_group.size
    if n == 1:
        return x
    scatter_sizes = scatter_sizes or [x.shape[scatter_axis] // n] * n
    gather_sizes = gather_sizes or [x.shape[gather_axis]] * n
    return AllToAll.apply(x, mesh_group, scatter_axis, gather_axis, list(scatter_sizes), list(gather_sizes), tag)


def _padded(x, axis, width):
    """`x` with zeros appended along `axis` up to `width` (gloo gathers equal shapes only)."""
    if x.shape[axis] >= width:
        return x
    pad = list(x.shape)
    pad[axis] = width - x.shape[axis]
    return paddle.concat([x, paddle.zeros(pad, x.dtype)], axis=axis)


def _gathered(x, mesh_group, axis, sizes, tag):
    """Every position's `x` concatenated along `axis` (uneven parts padded to the largest for the gather)."""
    parts = collectives.all_gather(mesh_group, _padded(x, axis, max(sizes)), tag=tag)
    return paddle.concat([paddle.slice(p, [axis], [0], [n]) for p, n in zip(parts, sizes)], axis=axis)


class GatherReplicated(PyLayer):
    """All-gather along `axis` for a consumer that every rank runs identically.

    `sizes[j]`: how much of `axis` position j holds (uneven parts are padded
    to the largest for the gather, then trimmed). Backward keeps this rank's
    slice of the (replicated) gradient: no reduction, since each rank already
    holds the whole gradient.
    """

    @staticmethod
    def forward(ctx, x, mesh_group, axis, sizes, tag="all_gather"):
        ctx.args = (axis, sum(sizes[: mesh_group.index]), x.shape[axis])
        return _gathered(x, mesh_group, axis, sizes, tag)

    @staticmethod
    def backward(ctx, grad):
        axis, start, size = ctx.args
        return paddle.slice(grad, [axis], [start], [start + size])


def gather_replicated(x, mesh_group, axis, sizes=None, tag="all_gather"):
    if mesh_group.size == 1:
        return x
    sizes = list(sizes) if sizes is not None else [x.shape[axis]] * mesh_group.size
    return GatherReplicated.apply(x, mesh_group, axis, sizes, tag)


class GatherSummed(PyLayer):
    """All-gather along `axis` for consumers that differ by rank (each uses the parts it needs, or a
    statistic over every rank's tokens counted once in the loss): backward sums every rank's gradient of
    each part and hands each owner its own (a reduce-scatter, the all-gather's mirror). `sizes[j]`: how
    much of `axis` position j holds."""

    @staticmethod
    def forward(ctx, x, mesh_group, axis, sizes, tag="all_gather"):
        ctx.args = (mesh_group, axis, sizes, tag)
        return _gathered(x, mesh_group, axis, sizes, tag)

    @staticmethod
    def backward(ctx, grad):
        mesh_group, axis, sizes, tag = ctx.args
        chunks = [_padded(part, axis, max(sizes)) for part in paddle.split(grad, sizes, axis=axis)]
        mine = collectives.reduce_scatter(mesh_group, chunks, tag=tag)
        return paddle.slice(mine, [axis], [0], [sizes[mesh_group.index]])


def gather_summed(x, mesh_group, axis, sizes=None, tag="all_gather"):
    if mesh_group.size == 1:
        return x
    sizes = list(sizes) if sizes is not None else [x.shape[axis]] * mesh_group.size
    return GatherSummed.apply(x, mesh_group, axis, sizes, tag)


# Tensor-parallel pairs (Megatron's f/g): a replicated input entering column-split
# weights, and partial outputs leaving row-split ones.

class CopyToGroup(PyLayer):
    """Identity forward; backward sums the gradient over the group (each rank's
    column slice contributed only part of the input's gradient)."""

    @staticmethod
    def forward(ctx, x, mesh_group):
        ctx.mesh_group = mesh_group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_reduce(ctx.mesh_group, grad.clone(), tag="tp_all_reduce")


def copy_to_group(x, mesh_group):
    if mesh_group.size == 1 or x.stop_gradient:
        return x
    return CopyToGroup.apply(x, mesh_group)


class ReduceFromGroup(PyLayer):
    """Sum of every rank's partial result forward; the gradient of a sum is the same on every rank."""

    @staticmethod
    def forward(ctx, x, mesh_group):
        return collectives.all_reduce(mesh_group, x.clone(), tag="tp_all_reduce")

    @staticmethod
    def backward(ctx, grad):
        return grad


def reduce_from_group(x, mesh_group):
    if mesh_group.size == 1:
        return x
    return ReduceFromGroup.apply(x, mesh_group)


class SplitToGroup(PyLayer):
    """This rank's equal slice of a replicated tensor along `axis`; backward all-gathers
    the slices' gradients (the mirror of GatherReplicated)."""

    @staticmethod
    def forward(ctx, x, mesh_group, axis):
        ctx.args = (mesh_group, axis)
        size = x.shape[axis] // mesh_group.size
        start = mesh_group.index * size
        return paddle.slice(x, [axis], [start], [start + size]).contiguous()

    @staticmethod
    def backward(ctx, grad):
        mesh_group, axis = ctx.args
        return paddle.concat(collectives.all_gather(mesh_group, grad, tag="all_gather"), axis=axis)


def split_to_group(x, mesh_group, axis):
    n = mesh_group.size
    if n == 1:
        return x
    axis = axis % x.ndim
    if x.shape[axis] % n:
        raise ValueError(f"cannot split dim {axis} of size {x.shape[axis]} evenly over {n} ranks")
    return SplitToGroup.apply(x, mesh_group, axis)
