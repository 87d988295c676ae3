"""Halo exchange along one axis of a tensor split over a line of ranks (a Conv2D's width split over mp).

Each rank borrows `left` edge columns from its left neighbour and `right` from its
right one; the two ends of the line get zeros there (the convolution's zero padding).
Two ring shifts carry them: every rank sends its last `left` columns to the right and
its first `right` columns to the left, so each message holds exactly one halo. An
all-gather of the edge columns would hand every rank all n-1 other ranks' edges; the
shift's only waste is its wrap-around message (last rank to first and back), which the
receiving end drops. The ordered shift is the one gloo's blocking send/recv can run.
"""
from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from .p2p import shift


def _columns(x, axis, start, stop):
    return paddle.slice(x, [axis], [start], [stop])


def _zeros_like_columns(x, axis, width):
    shape = list(x.shape)
    shape[axis] = width
    return paddle.zeros(shape, x.dtype)


def _borrow(mesh_group, x, axis, width, offset, tag):
    """`width` columns from the neighbour at index-offset: its last ones when offset is +1 (it sits on
    the left), its first ones when -1; zeros at the end of the line that has no such neighbour."""
    if width == 0:
        return None
    size = x.shape[axis]
    edge = _columns(x, axis, size - width, size) if offset > 0 else _columns(x, axis, 0, width)
    received = shift(mesh_group, edge, offset, tag=tag).wait()
    at_end = mesh_group.index == (0 if offset > 0 else mesh_group.size - 1)
    return _zeros_like_columns(x, axis, width) if at_end else received


def _return_gradients(mesh_group, grad, axis, left, right, tag):
    """The halos' gradients go back to the neighbours they came from and are added to those edges."""
    size = grad.shape[axis] - left - right
    own = _columns(grad, axis, left, left + size).clone()
    index = [slice(None)] * grad.ndim
    if left:  # my left halo was my left neighbour's last columns: send it left, get my last columns' share
        from_right = shift(mesh_group, _columns(grad, axis, 0, left), -1, tag=tag).wait()
        if mesh_group.index != mesh_group.size - 1:
            index[axis] = slice(size - left, size)
            own[tuple(index)] = own[tuple(index)] + from_right
    if right:  # my right halo was my right neighbour's first columns
        from_left = shift(mesh_group, _columns(grad, axis, left + size, left + size + right), 1, tag=tag).wait()
        if mesh_group.index != 0:
            index[axis] = slice(0, right)
            own[tuple(index)] = own[tuple(index)] + from_left
    return own


class HaloExchange(PyLayer):
    """[.., w, ..] -> [.., left + w + right, ..]; backward [.., left + w + right, ..] -> [.., w, ..]."""

    @staticmethod
    def forward(ctx, x, mesh_group, axis, left, right, tag):
        ctx.args = (mesh_group, axis, left, right, tag)
        parts = [_borrow(mesh_group, x, axis, left, 1, tag), x, _borrow(mesh_group, x, axis, right, -1, tag)]
        return paddle.concat([p for p in parts if p is not None], axis=axis)

    @staticmethod
    def backward(ctx, grad):
        mesh_group, axis, left, right, tag = ctx.args
        return _return_gradients(mesh_group, grad, axis, left, right, tag)


def exchange_halo(x, mesh_group, axis, left, right, tag="conv_halo"):
    """`x` widened along `axis` by its neighbours' `left` and `right` edge columns (zeros past the
    line's ends); differentiable. Every rank's part must be at least `left` and `right` wide."""
    axis = axis % x.ndim
    if left == 0 and right == 0:
        return x
    if x.shape[axis] < max(left, right):
        raise ValueError(f"a halo of {max(left, right)} columns needs parts at least that wide along dim {axis}, "
                         f"got {x.shape[axis]}")
    return HaloExchange.apply(x, mesh_group, axis, left, right, tag)
