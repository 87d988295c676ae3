"""The planned k/v exchange: a member's k/v rows go straight to the members whose tiles read them
(exchange_plan.py), and only those rows' gradients come back.

At step s (1..N-1) member i sends member i+s the rows of its block that i+s reads and receives from i-s the
rows of i-s's block it reads: one shift by s a step (p2p.shift: batched isend/irecv on NCCL, ordered
send/recv on gloo, an empty message where nothing is read), the next step's in flight while this one is
computed on. The rows arrive packed (k then v, [b, n, h, d] each) and are put back in place in a block of
the sender's length whose other rows are 0. Those are rows no query of this member sees, so the kernels,
running the same tiles in the same order as on the whole block, give the whole block's results bit for
bit: a key no query sees weighs exactly 0, and its gradient is exactly 0 (on CPU, Paddle's exp(-inf) =
2.9e-39 in the blockwise kernel leaves ~1e-38 there, which the whole block would have had).

Backward: at step s member i sends home to i-s the gradients of the rows of i-s's block it read, and
receives from i+s those of its own block's rows that i+s read; the owner adds them as they arrive (from
i+1, then i+2, ...), the order in which a ring passing sums along would add them, then its own part last.

Bytes: the rows read, forward and again in backward (k/v are fetched again, as the ring does outside
recomputation), and their gradients: exchange_plan.exchange_bytes' `planned`, 3 x the rows read. Under
recomputation the backward reads the rows its replay's forward received (`received`, ring.keeps_received):
the rows read in the first forward, in the replay and their gradients, 3 x the rows read again instead of
4 x, N-1 shifts in the backward instead of 2(N-1), one layer's received rows held from the replay to its
backward. The row indices go to the device once per batch.
A block read whole (nothing masked, most blocks of one causal document) goes as it is: no row selection
and no scatter back, one pack (concat) a step as the ring's.

On NCCL each step is one `dist.batch_isend_irecv` (p2p.shift): Paddle coalesces the list's isend/irecv in
one group call (ncclGroupStart/End) on the group's communication stream and returns one task per op; the
peers' lists must pair up, so a member leaves out its isend exactly when its receiver leaves out the
matching irecv (both sides know the plan's count: an empty message is never posted, and a step with
neither is no call, since Paddle's batch refuses an empty list; the group's communicator was started by
p2p.shift on every member first). Buffers are not touched before wait().
"""
from __future__ import annotations


import numpy as np
import paddle

from ...comm import p2p
from .rotation import GRAD_DTYPE, BlockPacking


class MemberExchange:
    """One member's side of an ExchangePlan, its row indices copied to the device once (ring.RingMasks keeps
    it with the batch's masks)."""

    def __init__(self, plan, index):
        self.plan, self.index = plan, index
        self._device = {}

    def _cached(self, key, make):
        if key not in self._device:
            self._device[key] = paddle.to_tensor(make())
        return self._device[key]

    def count_sent(self, receiver):
        return int(self.plan.counts[receiver, self.index])

    def count_read(self, sender):
        return int(self.plan.counts[self.index, sender])

    def sent(self, receiver):
        """int64 [n]: the rows of this member's block `receiver` reads."""
        return self._cached(("sent", receiver), lambda: self.plan.rows(receiver, self.index))

    def read(self, sender):
        """int64 [n]: the rows of `sender`'s block this member reads."""
        return self._cached(("read", sender), lambda: self.plan.rows(self.index, sender))

    def placement(self, sender):
        """int64 [len(sender's block)]: each row's place among the rows read; a row not read points just past
        them (at a zero row)."""
        def make():
            read = self.plan.read_by(sender)[self.index]
            return np.where(read, np.cumsum(read) - 1, read.sum())
        return self._cached(("placement", sender), make)


class PlannedRotation:
    """rotation.py's interface over a MemberExchange (`masks.exchange()`)."""

    def __init__(self, group, k, v, masks, received=None):
        self.group, self.k, self.v, self.received = group, k, v, received
        self.exchange = masks.exchange() if group.size > 1 else None  # a ring of one exchanges nothing
        self.packing = BlockPacking(k, v, masks.lengths())
        self._next = self._arriving = self._own = self._others = None

    def _member(self, offset):
        return (self.group.index + offset) % self.group.size

    def _shift(self, tensors, rows, count, offset, recv_rows, dtype):
        """Rows `rows` (`count` of them) of `tensors` ([b, L, ...] each), packed, to member index+offset;
        `recv_rows` rows' worth from index-offset. `tensors` None: `count` rows of zeros."""
        if not count:
            out = paddle.empty([0], dtype)
        elif tensors is None:
            out = paddle.zeros([self.packing.numel(count)], dtype)
        elif count == tensors[0].shape[1]:  # read whole
            out = p2p.pack(list(tensors))
        else:
            out = p2p.pack([_select_rows(t, rows) for t in tensors])
        return p2p.shift(self.group, out, offset, tag="ring", recv_shape=[self.packing.numel(recv_rows)])

    def fetch(self, step):
        """The rows of member index-step's block this member reads (None at step 0: its own block); the next
        step's are put in flight first; with `received`, that step's kept message."""
        if self.received is not None:
            return self.received[step]
        message = None if step == 0 else self._next.wait()
        if step < self.group.size - 1:
            receiver, sender = self._member(step + 1), self._member(-step - 1)
            count = self.exchange.count_sent(receiver)
            self._next = self._shift([self.k, self.v], self.exchange.sent(receiver) if count else None, count,
                                     step + 1, self.exchange.count_read(sender), self.k.dtype)
        return message

    def unpack(self, message, src):
        """k and v blocks of member `src`, the rows not read 0."""
        if src == self.group.index:
            return self.k, self.v
        count = self.exchange.count_read(src)
        parts = p2p.unpack(message, self.packing.shapes(count))
        if count == self.packing.lengths[src]:
            return parts
        placement = self.exchange.placement(src)
        return [_select_rows(paddle.concat([part, paddle.zeros([part.shape[0], 1, *part.shape[2:]], part.dtype)],
                                           axis=1), placement)  # [b, n + 1, ...] -> [b, L_src, ...]
                for part in parts]

    def send_grads(self, step, grads):
        """(dk, dv) of the block fetched at `step`: its rows read go home; the gradients of this member's rows
        the member `step` ahead read arrive. None: the block was skipped (ring.sees_nothing). Its owner still
        waits for the rows the plan counts (a dense mask can hide rows the plan's bounds read, and only this
        member holds its rows of it): they go as zeros, so both sides' calls match."""
        if step == 0:
            self._own = grads
            return
        self._add_arrived()
        owner, reader = self._member(-step), self._member(step)
        count = self.exchange.count_read(owner)
        self._arriving = reader, self._shift(grads, self.exchange.read(owner) if count else None, count, -step,
                                             self.exchange.count_sent(reader), GRAD_DTYPE)

    def _add_arrived(self):
        if self._arriving is None:
            return
        (reader, pending), self._arriving = self._arriving, None
        flat, count = pending.wait(), self.exchange.count_sent(reader)
        if not count:
            return
        rows = self.exchange.sent(reader)
        parts = p2p.unpack(flat, self.packing.shapes(count))
        if self._others is None:
            own_shapes = self.packing.shapes(self.packing.lengths[self.group.index])
            self._others = [paddle.zeros(shape, part.dtype) for shape, part in zip(own_shapes, parts)]
        self._others = [paddle.index_add(total, rows, 1, part) for total, part in zip(self._others, parts)]

    def own_grads(self):
        """(dk, dv) of this member's block: its own part plus the others' sum."""
        self._add_arrived()
        own, others = self._own, self._others
        if own is None and others is None:
            return [paddle.zeros(shape, GRAD_DTYPE)
                    for shape in self.packing.shapes(self.packing.lengths[self.group.index])]
        if own is None or others is None:
            return own if others is None else others
        return [mine + theirs for mine, theirs in zip(own, others)]


def _select_rows(tensor, index):
    """tensor[:, index] of a [b, L, ...] tensor (int64 index on its device). Paddle's CPU build has no fp16
    index_select: there the rows are selected in fp32, which holds every fp16 value exactly."""
    if tensor.dtype == paddle.float16 and tensor.place.is_cpu_place():
        return paddle.index_select(tensor.astype(paddle.float32), index, axis=1).astype(tensor.dtype)
    return paddle.index_select(tensor, index, axis=1)
