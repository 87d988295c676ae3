"""Collectives over a MeshGroup, results in mesh order.

Native Paddle collectives where the backend has them; on gloo, all-to-all and
reduce-scatter are emulated with N-1 rounds of ordered point-to-point
exchanges, which move exactly the bytes per rank the real operations move.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import paddle
import paddle.distributed as dist

from . import counters, p2p
from .watchdog import guard


def _sorted_positions(mesh_group):
    """Paddle orders a group's ranks by rank id; map that order to mesh order."""
    by_id = sorted(mesh_group.ranks)
    return [by_id.index(r) for r in mesh_group.ranks]


def all_gather(mesh_group, tensor, tag="all_gather"):
    """List of every position's tensor, in mesh order."""
    if mesh_group.size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    counters.record(tag, counters.nbytes(tensor) * (mesh_group.size - 1))
    gathered = []
    with guard(tag, mesh_group.ranks):
        dist.all_gather(gathered, tensor, group=mesh_group.group)
    return [gathered[i] for i in _sorted_positions(mesh_group)]


def gathered_digests(mesh_group, data, tag):
    """Every position's crc32 of its `data` (bytes), in mesh order: one all-gather of one number, so the
    ranks can tell whether they hold the same value (every rank gets the same list)."""
    digest = paddle.to_tensor(np.array([zlib.crc32(data)], dtype="int64"))
    return [int(d.numpy()[0]) for d in all_gather(mesh_group, digest, tag=tag)]


def all_reduce(mesh_group, tensor, tag="all_reduce"):
    """Sum `tensor` over the group in place (ring cost: 2(N-1)/N of its bytes)."""
    if mesh_group.size == 1:
        return tensor
    _all_reduce(mesh_group, tensor, tag, sync_op=True)
    return tensor


class Done:
    """The handle of a collective that has completed already (gloo, a group of one)."""

    @staticmethod
    def wait():
        return True


def all_reduce_async(mesh_group, tensor, tag="all_reduce"):
    """Start summing `tensor` over the group in place; returns a handle whose `wait()` makes later work on the
    compute stream wait for the result. NCCL: issued on its communication stream (`sync_op=False`), the host
    goes on at once; gloo: `all_reduce`, done before it returns."""
    if mesh_group.size == 1 or not p2p.uses_native_p2p(tensor):
        all_reduce(mesh_group, tensor, tag=tag)
        return Done
    task = _all_reduce(mesh_group, tensor, tag, sync_op=False)
    return task if task is not None else Done  # None: a synchronous stand-in (tests)


def _all_reduce(mesh_group, tensor, tag, sync_op):
    n = mesh_group.size
    counters.record(tag, counters.nbytes(tensor) * 2 * (n - 1) // n)  # what NCCL moves, in the tensor's dtype
    if tensor.dtype == paddle.float16 and not p2p.uses_native_p2p(tensor):
        return _gloo_float16_all_reduce(mesh_group, tensor, tag)
    with guard(tag, mesh_group.ranks):
        return dist.all_reduce(tensor, group=mesh_group.group, sync_op=sync_op)


def _gloo_float16_all_reduce(mesh_group, tensor, tag):
    """gloo's float16 all_reduce sums wrongly in Paddle 3.3.1 (1 + 2 gives inf, measured): summed in float32
    and written back rounded, the result NCCL gives (it sums float16 in float16, one rounding per hop: at most
    as exact). Counted by tag (counters.widened_float16)."""
    wide = tensor.astype(paddle.float32)
    with guard(tag, mesh_group.ranks):
        dist.all_reduce(wide, group=mesh_group.group)
    paddle.assign(wide.astype(paddle.float16), output=tensor)
    counters.record_widened_float16(tag)


def broadcast(mesh_group, tensor, src_index=0, tag="broadcast"):
    if mesh_group.size == 1:
        return tensor
    if mesh_group.index == src_index:
        counters.record(tag, counters.nbytes(tensor))
    with guard(tag, mesh_group.ranks):
        dist.broadcast(tensor, src=mesh_group.rank_at(src_index), group=mesh_group.group)
    return tensor


def all_to_all(mesh_group, chunks, tag="all_to_all", recv_shapes=None):
    """Send chunks[j] to position j; return the chunk each position sent here, in mesh order.

    `recv_shapes[j]` is the shape of the chunk position j sends here (default:
    the shape of chunks[j], right for even splits).
    """
    n = mesh_group.size
    if len(chunks) != n:
        raise ValueError(f"all_to_all needs one chunk per rank: got {len(chunks)} for {n} ranks")
    if n == 1:
        return list(chunks)
    chunks = [c.contiguous() for c in chunks]
    me = mesh_group.index
    if not p2p.uses_native_p2p(chunks[0]):
        return _all_to_all_rounds(mesh_group, chunks, tag, recv_shapes)
    counters.record(tag, sum(counters.nbytes(c) for j, c in enumerate(chunks) if j != me))
    order = _sorted_positions(mesh_group)
    received = [paddle.empty(recv_shapes[j] if recv_shapes else chunks[j].shape, chunks[j].dtype) for j in range(n)]
    with guard(tag, mesh_group.ranks):
        dist.alltoall(_in_group_order(order, received), _in_group_order(order, chunks), group=mesh_group.group)
    return received


def _in_group_order(order, per_position):
    """Reorder a per-mesh-position list into Paddle's group-rank order (same objects)."""
    by_group_rank = [None] * len(order)
    for position, group_rank in enumerate(order):
        by_group_rank[group_rank] = per_position[position]
    return by_group_rank


def _all_to_all_rounds(mesh_group, chunks, tag, recv_shapes):
    n, me = mesh_group.size, mesh_group.index
    received = [None] * n
    received[me] = chunks[me]
    with counters.one_collective(tag):
        for offset in range(1, n):
            # Round `offset`: send to me+offset, receive from me-offset.
            src = (me - offset) % n
            shape = recv_shapes[src] if recv_shapes else None
            received[src] = p2p.shift(mesh_group, chunks[(me + offset) % n], offset, tag, shape).wait()
    return received


def reduce_scatter(mesh_group, chunks, tag="reduce_scatter"):
    """Sum over ranks of chunks[me]: each position gets its own reduced chunk. Chunk j has one shape on every
    rank; shapes may differ between positions, and a chunk may be empty (its position receives nothing). NCCL:
    one collective where it moves no more bytes than reducing each chunk onto its position
    (`_native_reduce_scatter`); gloo: N-1 ordered exchanges."""
    n = mesh_group.size
    if n == 1:
        return chunks[0]
    chunks = [c.contiguous() for c in chunks]
    if p2p.uses_native_p2p(chunks[0]):
        out, task = _native_reduce_scatter(mesh_group, chunks, tag, sync_op=True)
        return out
    me = mesh_group.index
    # every gloo exchange moves something: an empty chunk travels as one zero
    stand_ins = [c if math.prod(c.shape) else paddle.zeros([1], c.dtype) for c in chunks]
    total = _reduce_scatter_rounds(mesh_group, stand_ins, tag)
    return total if math.prod(chunks[me].shape) else chunks[me]


def reduce_scatter_async(mesh_group, chunks, tag="reduce_scatter"):
    """(this position's reduced chunk, handle): as `all_reduce_async`, the chunk is final after `wait()`; gloo
    (no reduce-scatter there: N-1 ordered exchanges) is `reduce_scatter`, done before it returns."""
    if mesh_group.size == 1 or not p2p.uses_native_p2p(chunks[0]):
        return reduce_scatter(mesh_group, chunks, tag=tag), Done
    out, task = _native_reduce_scatter(mesh_group, [c.contiguous() for c in chunks], tag, sync_op=False)
    return out, task


class _Tasks:
    def __init__(self, tasks, buffers=()):
        self._tasks = [t for t in tasks if t is not None]  # None: a synchronous stand-in (tests)
        self._buffers = buffers  # inputs made here, kept until the collective has read them (its own stream)

    def wait(self):
        for task in self._tasks:
            task.wait()
        self._buffers = ()
        return True


def pads_uneven_chunks(sizes):
    """Whether one reduce-scatter of the chunks (numels `sizes`) padded to the largest moves no more bytes per
    rank than one reduce per non-empty chunk: (N-1) x largest against their sum (ring algorithms). Equal chunks
    always; owners of about equal shares too; a bucket one or two owners hold would move up to N-1 times its
    bytes padded (a Llama-3-8B layer's weight is a 25 MiB bucket of its own: docs/tensor_parallel.md)."""
    return (len(sizes) - 1) * max(sizes) <= sum(sizes)


def _native_reduce_scatter(mesh_group, chunks, tag, sync_op):
    """NCCL: one reduce_scatter of the chunks, each padded to the largest with zeros, in one flat buffer (one
    kernel), or, where padding would move more bytes (`pads_uneven_chunks`), one reduce per non-empty chunk onto
    its position (summed in place: the chunks are this call's own buffers)."""
    me, n = mesh_group.index, mesh_group.size
    sizes = [math.prod(c.shape) for c in chunks]
    width, dtype = max(sizes), chunks[0].dtype
    with guard(tag, mesh_group.ranks):
        if pads_uneven_chunks(sizes):
            counters.record(tag, (n - 1) * width * chunks[0].element_size())
            pad = paddle.zeros([width - min(sizes)], dtype) if min(sizes) < width else None  # shared by every chunk
            parts = []
            for j in _in_group_order(_sorted_positions(mesh_group), list(range(n))):
                parts += [chunks[j].reshape([-1])] if sizes[j] else []
                parts += [pad[: width - sizes[j]]] if sizes[j] < width else []
            flat = paddle.concat(parts)  # [n * width]: position j's chunk at its group rank's slot
            out = paddle.empty([width], dtype)
            task = dist.stream.reduce_scatter(out, flat, group=mesh_group.group, sync_op=sync_op)
            return out[: sizes[me]].reshape(chunks[me].shape), _Tasks([task], buffers=(flat,))
        counters.record(tag, sum(counters.nbytes(c) for j, c in enumerate(chunks) if j != me))
        tasks = [dist.reduce(c, dst=mesh_group.rank_at(j), group=mesh_group.group, sync_op=sync_op)
                 for j, c in enumerate(chunks) if sizes[j]]
    return chunks[me], _Tasks(tasks)


def _reduce_scatter_rounds(mesh_group, chunks, tag):
    n, me = mesh_group.size, mesh_group.index
    total = chunks[me].clone()
    with counters.one_collective(tag):
        for offset in range(1, n):
            total = total + p2p.shift(mesh_group, chunks[(me + offset) % n], offset, tag,
                                         chunks[me].shape).wait()
    return total
