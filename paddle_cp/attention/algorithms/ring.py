"""Ring attention: q stays, every ring member's k/v block comes by (rotation.py).

Each rank's queries meet member src's keys through a BlockMask built from both
sides' global positions, so causal balance needs no special schedule: with
the balanced layout (layout.py) rank r holds chunks r and 2N-1-r, and against
any other rank's block exactly half of its query-key tiles are visible; the
kernel skips the rest. The same masks carry documents and dense masks.
Partial results merge by log-sum-exp; queries that see nothing in a block
contribute 0 with weight 0, and a block no query sees runs no kernel, forward
or backward (`sees_nothing`).

The backward needs the other members' k/v again. Outside recomputation it fetches them again: holding every
layer's received rows until its backward would cost ~10.5 GiB a rank (Llama-3-8B, bf16, 128K tokens of one
causal document over 8 ranks). In a replay, whose backward follows at once (activations/replay.py), the
forward keeps the messages of the steps that ran a kernel and the backward reads them (`keeps_received`): 3 x
the rows read a layer cross the links instead of 4 x, and the backward posts only the gradients' shifts. What
one replay's ring calls keep stays within cost.exchange.REPLAY_HOLD_LIMIT; past it the backward fetches again.
The kernels run the same tiles on the same bytes in the same order either way: results bit for bit alike
(docs/context_parallel.md, "Under recomputation the backward reads the replay's k/v").
"""
from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from ...activations import recompute
from ...activations.replay import hold_briefly, saved_only_briefly
from ...cost import exchange as cost_exchange
from ..layout.exchange_plan import ExchangePlan
from ..kernels import saveable, select_kernel
from ..layout.sequence_layout import runs
from ..masks.block_mask import BlockMask, record_work
from .merge import merge
from .planned_exchange import MemberExchange, PlannedRotation
from .rotation import AllGatherRotation, BlockPacking, check_rotation


class RingMasks:
    """BlockMasks of this member's queries against each ring member's keys, each made once (the
    forward and backward of every layer of a batch read the same; api.py keeps them per batch).

    `positions[i]`: global positions of member i's tokens; `mask`: the call's Mask (masks/mask.py), its
    dense mask holding this member's rows, [b, 1|h, len(positions[index]), seq_len];
    `cuts`: the layout's chunk starts; `fragment`: as BlockMask's.
    """

    def __init__(self, positions, index, mask, cuts=(), fragment=0):
        self.positions, self.index, self.cuts = positions, index, cuts
        self.mask, self.fragment = mask, fragment
        self._blocks, self._exchange = {}, None
        self._exchange_of = None  # the masks without the dense mask whose exchange plan these share

    def with_dense(self, dense):
        """These masks with this member's rows of a dense mask (a layer's tensor: made per call), sharing this
        one's exchange plan, which reads only the row bounds (made once per batch)."""
        masks = RingMasks(self.positions, self.index, self.mask.with_dense(dense), self.cuts, self.fragment)
        masks._exchange_of = self
        return masks

    def lengths(self):
        return [len(p) for p in self.positions]

    def block(self, src):
        if src not in self._blocks:
            keys = self.positions[src]
            mask = self.mask
            self._blocks[src] = BlockMask(self.positions[self.index], keys, mask.causal, mask.documents,
                                          self._columns(keys), self.cuts, mask.window, mask.valid, self.fragment)
        return self._blocks[src]

    def exchange(self):
        """This member's side of the batch's ExchangePlan (the planned rotation's rows), made once."""
        if self._exchange_of is not None:
            return self._exchange_of.exchange()
        if self._exchange is None:
            mask = self.mask
            plan = ExchangePlan(self.positions, mask.causal, mask.documents, mask.window, mask.valid)
            self._exchange = MemberExchange(plan, self.index)
        return self._exchange

    def _columns(self, keys):
        dense = self.mask.dense
        if dense is None:
            return None
        parts = [dense[:, :, :, int(keys[a]):int(keys[b - 1]) + 1] for a, b in runs(keys)]
        return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=3)


def sees_nothing(mask):
    """No query of the block sees any of its keys: its partial output weighs 0 and its gradients are 0, so
    neither direction runs a kernel on it (a document kept whole on another rank, a window's far blocks)."""
    return mask.extent().kind == "none"


def make_rotation(rotate, group, k, v, masks, received=None):
    """How this member's k [b, s_i, h, d] and v reach the others over the ring `group` (rotation.py);
    `received`: the messages a forward kept (`keeps_received`), fetched from there instead."""
    kinds = {"planned": PlannedRotation, "allgather": AllGatherRotation}
    return kinds[check_rotation(rotate)](group, k, v, masks, received)


def keeps_received(rotate, group, k, v, masks):
    """Whether a ring forward called now keeps the k/v messages it receives for its backward: where what it saves
    is held only briefly (activations/replay.py: a replay, whose backward follows at once) and the busiest
    member's received k/v, with what the replay's ring calls before it kept, fit cost.exchange.REPLAY_HOLD_LIMIT
    (replay.hold_briefly), decided alike on every member (from the plan and the blocks' lengths: the backward's
    shifts pair up) and in both runs of a recompute call."""
    return group.size > 1 and saved_only_briefly() and hold_briefly(received_bytes(rotate, k, v, masks),
                                                                     cost_exchange.REPLAY_HOLD_LIMIT)


def received_bytes(rotate, k, v, masks):
    """Bytes of k/v [b, s_i, h, d] the busiest member receives in one forward (what its kept messages hold):
    the rows read (planned), or every whole block padded to the longest (allgather)."""
    packing = BlockPacking(k, v, masks.lengths())
    row_bytes = packing.numel(1) * k.element_size()
    if rotate == "planned":
        return int(cost_exchange.received_rows(masks.exchange().plan.counts).max()) * row_bytes
    return len(packing.lengths) * max(packing.lengths) * row_bytes


def ring_forward(q, k, v, group, masks, scale, rotate, keep=False):
    """(out, lse, kept): `kept` (with `keep`) the message of each step that ran a kernel (None at the others),
    for ring_backward's `received`; else None."""
    rotation = make_rotation(rotate, group, k, v, masks)
    out = lse = None
    kept = [None] * group.size if keep else None
    for step in range(group.size):
        src = (group.index - step) % group.size
        message = rotation.fetch(step)  # fetched even when skipped: it puts the next step's in flight
        mask = masks.block(src)
        if sees_nothing(mask):
            record_work(0, q.shape[1] * masks.lengths()[src])
            continue
        if keep and message is not None:
            kept[step], = saveable(message)  # an all-gather's block may be a view (non-reentrant recompute saves it)
        k_block, v_block = rotation.unpack(message, src)
        block_out, block_lse = select_kernel(q, v, mask).forward(q, k_block, v_block, mask, scale)
        out, lse = merge(out, lse, block_out, block_lse)
    if out is None:  # no query here sees any key (a shard of padding): output 0, log-sum-exp -inf
        b, sq, hq, _ = q.shape
        out, lse = paddle.zeros([b, sq, hq, v.shape[3]], "float32"), paddle.full([b, hq, sq], float("-inf"), "float32")
    return out, lse, kept


def ring_backward(dout, q, k, v, out, lse, group, masks, scale, rotate, received=None):
    """Gradients of q and of this member's k/v; the blocks the forward skipped (`sees_nothing`) run no kernel
    here either (rotation.send_grads(step, None): the rotation sends zeros where its peer waits for them).
    `received`: the forward's kept messages (ring_forward), else k/v are fetched again."""
    rotation = make_rotation(rotate, group, k, v, masks, received)
    dq = None
    for step in range(group.size):
        src = (group.index - step) % group.size
        message = rotation.fetch(step)
        mask = masks.block(src)
        if sees_nothing(mask):
            rotation.send_grads(step, None)
            continue
        k_block, v_block = rotation.unpack(message, src)
        dq_block, dk_block, dv_block = select_kernel(q, v, mask).backward(
            dout, q, k_block, v_block, out, lse, mask, scale)
        dq = dq_block if dq is None else dq + dq_block
        rotation.send_grads(step, (dk_block, dv_block))
    dk, dv = rotation.own_grads()
    return (paddle.zeros(q.shape, "float32") if dq is None else dq), dk, dv


def _sink_lse(sinks, lse):
    """Per-head sink logits [h] as a block's log-sum-exp [b, h, s]."""
    return sinks.astype(lse.dtype).reshape([1, -1, 1]).expand(lse.shape)


class RingAttention(PyLayer):
    """Ring attention; `sinks` ([h] logits, or None) join every query's softmax denominator as a
    block whose output is 0. The final out and lse (sinks included) make the blockwise backward exact
    for q/k/v; a sink's own gradient is -sum over queries of P_sink * rowsum(dO * O)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, masks, scale, rotate, keep):
        out, lse, kept = ring_forward(q, k, v, group, masks, scale, rotate, keep)
        if sinks is not None:
            out, lse = merge(out, lse, paddle.zeros_like(out), _sink_lse(sinks, lse))
        out, lse = saveable(out.astype(q.dtype), lse)
        # kept messages saved as tensors: a non-reentrant recompute swaps them for the replay's too
        ctx.save_for_backward(q, k, v, sinks, out, lse, *(kept or ()))
        ctx.args, ctx.keep = (group, masks, scale, rotate), keep
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse, *kept = ctx.saved_tensor()
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args, received=kept if ctx.keep else None)
        grads = [dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)]
        if sinks is not None:
            p_sink = paddle.exp(_sink_lse(sinks, lse) - lse)  # [b, h, s]
            delta = (dout.astype("float32") * out.astype("float32")).sum(axis=-1).transpose([0, 2, 1])  # [b, h, s]
            grads.append((-(p_sink * delta).sum(axis=[0, 2])).astype(sinks.dtype))
        return tuple(grads)


def ring_attention_local(q, k, v, group, masks, scale, rotate="planned", sinks=None):
    """Attention of this member's [b, s_i, h, d] q/k/v shards (v: [b, s_i, h, d_v]) over the ring `group`."""
    recompute.install()  # a recompute call's replay then says so (keeps_received)
    q, k, v = saveable(q, k, v)
    keep = keeps_received(rotate, group, k, v, masks)
    return RingAttention.apply(q, k, v, sinks, group, masks, scale, rotate, keep)
