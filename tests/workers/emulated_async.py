"""NCCL's asynchronous point-to-point traffic and collectives, emulated over gloo for tests.

`install()` makes paddle_cp take its NCCL branches on CPU tensors
(comm.p2p.uses_native_p2p -> True): ring exchanges post one isend and one
irecv through `dist.batch_isend_irecv` and `wait()` later (the planned exchange leaves
out an empty side: a lone isend or irecv, never an empty list, which Paddle refuses); Ulysses and the
allgather rotation call `dist.alltoall` and `dist.stream.reduce_scatter` (one flat input).

The emulated batch returns at once and completes the exchange at the first
`wait()` of either task, through paddle_cp's ordered gloo exchange
(comm.p2p.exchange_in_order) on the MeshGroup that owns the Paddle group.
Misuse that NCCL would turn into silent corruption or a hang fails loudly here:
- a batch on a group whose communicator p2p.start_communicator has not started (NCCL would make it at
  that call, over all the group's ranks);
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

from paddle_cp import mesh, runtime
from paddle_cp.comm import collectives, p2p

EMULATION = "emulation"
_in_flight = []
posted = {"isend+irecv": 0, "isend": 0, "irecv": 0}  # batches posted, by their ops


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
    """One posted isend and/or irecv (None: left out); completes at the first wait()."""

    def __init__(self, send_op, recv_op):
        self.send_op, self.recv_op = send_op, recv_op
        self.sent = None if send_op is None else send_op.tensor.clone()
        if recv_op is not None:  # anything read before wait() is NaN (fill_ refuses NaN)
            paddle.assign(paddle.full(recv_op.tensor.shape, float("nan"), recv_op.tensor.dtype), output=recv_op.tensor)
        ops = [op for op in (send_op, recv_op) if op is not None]
        for op in ops:
            if not np.prod(op.tensor.shape):
                raise Misuse("an empty message was posted: NCCL would still launch for it")
        group = ops[0].group
        size = dist.get_world_size() if group is None else group.nranks
        self.mesh_group = _owner(group, (dist.get_rank(), *(op.peer for op in ops)), size)
        if tuple(sorted(self.mesh_group.ranks)) not in runtime.installed.started_communicators:
            raise Misuse("a batch on a group whose communicator was not started: NCCL would make it here, "
                         "waiting for every rank of the group, some of which may post nothing")
        index = self.mesh_group.ranks.index
        offsets = {(index(send_op.peer) - self.mesh_group.index) % size} if send_op is not None else set()
        offsets |= {(self.mesh_group.index - index(recv_op.peer)) % size} if recv_op is not None else set()
        if len(offsets) != 1:
            raise Misuse("send and receive peers are not one shift of the ring")
        self.offset = offsets.pop()
        self.done = False
        _in_flight.append(self)

    def wait(self):
        if self.done:
            return
        self.done = True
        _in_flight.remove(self)
        send = None if self.send_op is None else self.send_op.tensor
        recv = None if self.recv_op is None else self.recv_op.tensor
        if send is not None and not _same(send, self.sent):
            raise Misuse("a send buffer was modified before wait(): NCCL may still be reading it")
        if recv is not None and not bool(paddle.isnan(recv.astype(paddle.float32)).all()):
            raise Misuse("a receive buffer was written before wait(): NCCL may still be writing it")
        if send is not None and recv is not None:
            p2p.exchange_in_order(self.mesh_group, send, recv, self.offset)
        elif send is not None:  # its peer's irecv is lone too, or paired in the ordered exchange's order
            dist.send(send, dst=self.send_op.peer, group=self.mesh_group.p2p_group(self.send_op.peer))
        else:
            dist.recv(recv, src=self.recv_op.peer, group=self.mesh_group.p2p_group(self.recv_op.peer))


class _Task:
    def __init__(self, exchange):
        self._exchange = exchange

    def wait(self):
        self._exchange.wait()
        return True


def batch_isend_irecv(ops):
    kinds = [op.op for op in ops]
    if not ops:
        raise Misuse("Paddle's batch_isend_irecv refuses an empty list (it reads the first op's group)")
    if kinds not in ([dist.isend, dist.irecv], [dist.isend], [dist.irecv]):
        raise NotImplementedError(f"the emulation covers an isend and/or an irecv, in that order, got {kinds}")
    posted["+".join("isend" if kind is dist.isend else "irecv" for kind in kinds)] += 1
    send = ops[0] if kinds[0] is dist.isend else None
    exchange = _Exchange(send, ops[-1] if kinds[-1] is dist.irecv else None)
    return [_Task(exchange) for _ in ops]


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
    """Before any paddle_cp group exists."""
    dist.batch_isend_irecv, dist.alltoall, dist.stream.reduce_scatter = batch_isend_irecv, alltoall, reduce_scatter
    p2p.uses_native_p2p = lambda tensor: True
    # NCCL leaves a pair's empty messages out, so gloo, which carries them here, sees only some pairs of a group
    # exchange: its per-group message tags stay in step only with a group per pair (mesh.py makes those for
    # rings whose size is not a power of two; here for all)
    mesh.needs_pair_groups = lambda size: size > 1
