"""Point-to-point exchanges within a MeshGroup.

NCCL posts sends and receives together and returns at once (the caller computes
while they fly). Gloo has only blocking send/recv, so both sides are ordered to meet: along
every cycle of the shift permutation, even positions send first and odd ones
receive first (gloo's per-group message tags are handled in mesh.py).
"""
from __future__ import annotations

import math

import paddle
import paddle.distributed as dist

from .. import runtime
from . import counters
from .watchdog import guard

COMMUNICATOR_START = "communicator_start"  # the counters' tag of the all-reduce that starts a group's communicator


def uses_native_p2p(tensor):
    """Async NCCL p2p on GPU tensors; ordered blocking gloo p2p on CPU."""
    return not tensor.place.is_cpu_place()


def sends_first(index, size, shift):
    """Whether position `index` sends before receiving when every rank sends to index+shift."""
    step = shift % size
    start = index % math.gcd(size, step)
    position, at = 0, start
    while at != index:
        at = (at + step) % size
        position += 1
    return position % 2 == 0


class Pending:
    """A receive in flight; `wait()` returns the received tensor."""

    def __init__(self, buffer, tasks=()):
        self._buffer, self._tasks = buffer, list(tasks)

    def wait(self):
        for task in self._tasks:
            task.wait()
        self._tasks = []
        return self._buffer


def shift(mesh_group, tensor, offset=1, tag="p2p", recv_shape=None):
    """Send `tensor` to position index+offset and receive from index-offset.

    Every member of the group calls it, in the same order of calls (a shift is one permutation of the
    whole group). The received tensor has `tensor`'s dtype and `recv_shape` (default: its
    shape); either may have no elements (a planned exchange with nothing to say: gloo still
    sends the empty message, which keeps its per-group tags in step; NCCL leaves it out, and a member
    with neither side makes no call). NCCL makes a group's communicator at its first call there, over all
    the group's ranks, each waiting for all the others: the first shift on a group starts it by a
    1-element all-reduce every member makes (`start_communicator`), so members with nothing to send or
    receive then do not leave the others waiting.
    Returns a Pending receive. With NCCL the transfer overlaps whatever the caller
    does before `wait()`; with gloo it has completed on return.
    """
    size = mesh_group.size
    if size == 1 or offset % size == 0:
        return Pending(tensor)
    tensor = tensor.contiguous()
    buffer = paddle.empty(recv_shape if recv_shape is not None else tensor.shape, tensor.dtype)
    counters.record(tag, counters.nbytes(tensor))
    if uses_native_p2p(tensor):
        start_communicator(mesh_group)
        group = mesh_group.group
        dst = mesh_group.rank_at(mesh_group.index + offset)
        src = mesh_group.rank_at(mesh_group.index - offset)
        ops = [dist.P2POp(op, t, peer, group) for op, t, peer in ((dist.isend, tensor, dst), (dist.irecv, buffer, src))
               if math.prod(t.shape)]
        if not ops:
            return Pending(buffer)
        with guard(tag, mesh_group.ranks, (src, dst)):
            return Pending(buffer, dist.batch_isend_irecv(ops))
    exchange_in_order(mesh_group, tensor, buffer, offset, tag)
    return Pending(buffer)


def start_communicator(mesh_group):
    """Make the group's NCCL communicator on every member at once, the first time only (counted under
    COMMUNICATOR_START): its first batched isend/irecv would make it over all the group's ranks, and a member
    whose step has neither side would never join."""
    members = tuple(sorted(mesh_group.ranks))
    if members in runtime.installed.started_communicators:
        return
    runtime.installed.started_communicators.add(members)
    one = paddle.zeros([1], "float32")
    counters.record(COMMUNICATOR_START, counters.nbytes(one))
    with guard(COMMUNICATOR_START, mesh_group.ranks):
        dist.all_reduce(one, group=mesh_group.group)


def exchange_in_order(mesh_group, tensor, buffer, offset, tag="p2p"):
    """Gloo's blocking send to index+offset and receive (into `buffer`) from index-offset, ordered
    so that both sides of every message meet (see sends_first)."""
    dst = mesh_group.rank_at(mesh_group.index + offset)
    src = mesh_group.rank_at(mesh_group.index - offset)
    with guard(tag, mesh_group.ranks, (src, dst)):
        if sends_first(mesh_group.index, mesh_group.size, offset):
            dist.send(tensor, dst=dst, group=mesh_group.p2p_group(dst))
            dist.recv(buffer, src=src, group=mesh_group.p2p_group(src))
        else:
            dist.recv(buffer, src=src, group=mesh_group.p2p_group(src))
            dist.send(tensor, dst=dst, group=mesh_group.p2p_group(dst))


def pack(tensors):
    """Flatten several tensors into one buffer, so a step sends one message."""
    return paddle.concat([t.reshape([-1]) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape([-1])


def unpack(buffer, shapes):
    """Split a packed buffer back into tensors of `shapes`."""
    sizes = [math.prod(shape) for shape in shapes]
    parts = paddle.split(buffer, sizes) if len(shapes) > 1 else [buffer]
    return [p.reshape(shape) for p, shape in zip(parts, shapes)]
