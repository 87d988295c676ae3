"""NCCL's asynchronous point-to-point traffic and collectives, emulated over gloo for tests.

`install()` makes paddle_cp take its NCCL branches on CPU tensors
(comm.p2p.uses_native_p2p -> True): ring exchanges post one isend and one
irecv through `dist.batch_isend_irecv` and `wait()` later; Ulysses and the
allgather rotation call `dist.alltoall` and `dist.stream.reduce_scatter` (one flat input).

The emulated batch returns at once and completes the exchange at the first
`wait()` of either task, through paddle_cp's ordered gloo exchange
(comm.p2p.exchange_in_order) on the MeshGroup that owns the Paddle group.
Misuse that NCCL would turn into silent corruption fails loudly here:
- the receive buffer holds NaN until the exchange completes (read before wait);
- a send buffer changed before wait(), or a receive buffer written before it,
  raises Misuse on wait();
- `in_flight()` lists exchanges posted and not yet waited (a leak, or the
  overlap the ring relies on: its next exchange is in flight during compute).
All-to-all and reduce-scatter are routed to the existing gloo rounds of
comm.collectives (counted under the tag "emulation", so the NCCL
branch's own byte counts stay exact).
"""
from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist

from paddle_cp import runtime
from paddle_cp.comm import collectives, p2p

EMULATION = "emulation"
_in_flight = []


class Misuse(AssertionError):
    """A buffer in flight was touched before wait()."""


def in_flight():
    return list(_in_flight)


def _same(a, b):
    return np.array_equal(a.astype(paddle.float32).numpy(), b.astype(paddle.float32).numpy(), equal_nan=True)


def _owner(group, members, size):
    """This rank's MeshGroup whose Paddle group is `group` and holds `members` (first created wins,
    the same on every rank)."""
    for mine in runtime.installed.groups.values():
        same = mine.group is group or (mine.group is None and (group is None or group.id == 0))  # 0: default
        if same and mine.size == size and set(members) <= set(mine.ranks):
            return mine
    raise AssertionError(f"no paddle_cp MeshGroup owns group {group} with ranks {members}")


class _Exchange:
    """One posted isend + irecv; completes at the first wait()."""

    def __init__(self, send_op, recv_op):
        self.send, self.recv = send_op.tensor, recv_op.tensor
        self.sent = self.send.clone()
        # anything read before wait() is NaN (fill_ refuses NaN)
        paddle.assign(paddle.full(self.recv.shape, float("nan"), self.recv.dtype), output=self.recv)
        me = dist.get_rank()
        group = send_op.group
        size = dist.get_world_size() if group is None else group.nranks
        self.mesh_group = _owner(group, (me, send_op.peer, recv_op.peer), size)
        index = self.mesh_group.ranks.index
        self.offset = (index(send_op.peer) - self.mesh_group.index) % size
        if (self.mesh_group.index - index(recv_op.peer)) % size != self.offset:
            raise Misuse("send and receive peers are not one shift of the ring")
        self.done = False
        _in_flight.append(self)

    def wait(self):
        if self.done:
            return
        self.done = True
        _in_flight.remove(self)
        if not _same(self.send, self.sent):
            raise Misuse("a send buffer was modified before wait(): NCCL may still be reading it")
        if not bool(paddle.isnan(self.recv.astype(paddle.float32)).all()):
            raise Misuse("a receive buffer was written before wait(): NCCL may still be writing it")
        p2p.exchange_in_order(self.mesh_group, self.send, self.recv, self.offset)


class _Task:
    def __init__(self, exchange):
        self._exchange = exchange

    def wait(self):
        self._exchange.wait()
        return True


def batch_isend_irecv(ops):
    kinds = [op.op for op in ops]
    if kinds != [dist.isend, dist.irecv]:
        raise NotImplementedError(f"the emulation covers one isend then one irecv, got {kinds}")
    exchange = _Exchange(*ops)
    return [_Task(exchange), _Task(exchange)]


def _mesh_order(group):
    """The MeshGroup of `group`, and for each of its positions the index in Paddle's group-rank
    order (ranks sorted), in which alltoall and reduce_scatter take their lists."""
    ranks = sorted(range(dist.get_world_size())) if group is None else sorted(group.ranks)
    mine = _owner(group, ranks, len(ranks))
    at = [ranks.index(rank) for rank in mine.ranks]
    return mine, at


def alltoall(out_tensor_list, in_tensor_list, group=None, sync_op=True):
    mine, at = _mesh_order(group)
    chunks = [in_tensor_list[g] for g in at]
    shapes = [out_tensor_list[g].shape for g in at]
    received = collectives._all_to_all_rounds(mine, chunks, EMULATION, shapes)
    for g, got in zip(at, received):
        paddle.assign(got, output=out_tensor_list[g])


def reduce_scatter(out_tensor, in_tensor, op=dist.ReduceOp.SUM, group=None, sync_op=True, use_calc_stream=False):
    """`dist.stream.reduce_scatter` with one flat input (the form paddle_cp calls): slot g of `in_tensor`
    (Paddle's group-rank order) is group rank g's chunk."""
    if op != dist.ReduceOp.SUM or not paddle.is_tensor(in_tensor):
        raise NotImplementedError("the emulation covers SUM over one flat input tensor")
    mine, at = _mesh_order(group)
    slots = paddle.split(in_tensor.reshape([len(at), -1]), len(at))  # [n, width] -> n x [1, width]
    chunks = [slots[g].reshape(out_tensor.shape) for g in at]
    paddle.assign(collectives._reduce_scatter_rounds(mine, chunks, EMULATION), output=out_tensor)


def install():
    dist.batch_isend_irecv, dist.alltoall, dist.stream.reduce_scatter = batch_isend_irecv, alltoall, reduce_scatter
    p2p.uses_native_p2p = lambda tensor: True
