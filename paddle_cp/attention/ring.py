"""Ring attention: q stays, every ring member's k/v block comes by (rotation.py).

Each rank's queries meet member src's keys through a BlockMask built from both
sides' global positions, so causal balance needs no special schedule: with
the balanced layout (layout.py) rank r holds chunks r and 2N-1-r, and against
any other rank's block exactly half of its query-key tiles are visible; the
kernel skips the rest. The same masks carry documents and dense masks.
Partial results merge by log-sum-exp; queries that see nothing in a block
contribute 0 with weight 0.
"""
from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from ..comm import p2p
from .kernels import saveable, select_kernel
from .layout import runs
from .mask import BlockMask
from .merge import merge
from .rotation import make_rotation


class RingMasks:
    """BlockMasks of this member's queries against each ring member's keys.

    `positions[i]`: global positions of member i's tokens; `dense`: this
    member's rows of a dense mask, [b, 1|h, len(positions[index]), seq_len];
    `cuts`: the layout's chunk starts.
    """

    def __init__(self, positions, index, causal, documents=None, dense=None, cuts=()):
        self.positions, self.index, self.cuts = positions, index, cuts
        self.causal, self.documents, self.dense = causal, documents, dense

    def lengths(self):
        return [len(p) for p in self.positions]

    def block(self, src):
        keys = self.positions[src]
        return BlockMask(self.positions[self.index], keys, self.causal, self.documents, self._columns(keys),
                         self.cuts)

    def _columns(self, keys):
        if self.dense is None:
            return None
        parts = [self.dense[:, :, :, int(keys[a]):int(keys[b - 1]) + 1] for a, b in runs(keys)]
        return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=3)


def _unpack(flat, like, length):
    """k and v of a member holding `length` tokens, from its packed block."""
    shape = [like.shape[0], length, *like.shape[2:]]
    return p2p.unpack(flat, [shape, shape])


def _numels(k, lengths):
    per_token = 2 * k.shape[0] * k.shape[2] * k.shape[3]
    return [per_token * n for n in lengths]


def ring_forward(q, k, v, group, masks, scale, kernel, rotate):
    lengths = masks.lengths()
    rotation = make_rotation(rotate, group, p2p.pack([k, v]), _numels(k, lengths))
    out = lse = None
    for step in range(group.size):
        src = (group.index - step) % group.size
        k_block, v_block = _unpack(rotation.fetch(step), k, lengths[src])
        mask = masks.block(src)
        block_out, block_lse = (kernel or select_kernel(q, mask)).forward(q, k_block, v_block, mask, scale)
        out, lse = merge(out, lse, block_out, block_lse)
    return out, lse


def ring_backward(dout, q, k, v, out, lse, group, masks, scale, kernel, rotate):
    lengths = masks.lengths()
    rotation = make_rotation(rotate, group, p2p.pack([k, v]), _numels(k, lengths))
    dq = None
    for step in range(group.size):
        src = (group.index - step) % group.size
        k_block, v_block = _unpack(rotation.fetch(step), k, lengths[src])
        mask = masks.block(src)
        dq_block, dk_block, dv_block = (kernel or select_kernel(q, mask)).backward(
            dout, q, k_block, v_block, out, lse, mask, scale)
        dq = dq_block if dq is None else dq + dq_block
        rotation.send_grads(step, p2p.pack([dk_block, dv_block]))
    dk, dv = _unpack(rotation.own_grads(), k, k.shape[1])
    return dq, dk, dv


class RingAttention(PyLayer):
    @staticmethod
    def forward(ctx, q, k, v, group, masks, scale, kernel, rotate):
        out, lse = ring_forward(q, k, v, group, masks, scale, kernel, rotate)
        out, lse = saveable(out.astype(q.dtype), lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, masks, scale, kernel, rotate)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensor()
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def ring_attention_local(q, k, v, group, masks, scale, kernel=None, rotate="ring"):
    """Attention of this member's [b, s_i, h, d] q/k/v shards over the ring `group`."""
    q, k, v = saveable(q, k, v)
    return RingAttention.apply(q, k, v, group, masks, scale, kernel, rotate)
