"""Ring attention (backend `p2p`): q stays, k/v blocks travel the ring.

Causal runs use the balanced layout (layout.py): rank r holds chunks r and
2N-1-r. At step s > 0 the arriving block comes from rank src = r - s; if
src < r all local queries see its first half, otherwise only the local second
half sees it, whole. Either way every rank does the same work each step.
The backward sends k/v around again and dk/dv travel with them back to their
owners. The next exchange is issued before computing on the current block.
"""
from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from ..comm import p2p
from .merge import merge


def block_plan(step, index, world, causal, length):
    """(query rows, key rows, causal) this rank computes at `step`, rows as (start, end)."""
    every, half = (0, length), length // 2
    if not causal:
        return every, every, False
    if step == 0:
        return every, every, True
    source = (index - step) % world
    if source < index:
        return every, (0, half), False
    return (half, length), every, False


def _rows(x, rows, axis=1):
    start, end = rows
    return x if (start, end) == (0, x.shape[axis]) else paddle.slice(x, [axis], [start], [end])


def _write_rows(full, part, rows, axis):
    """`full` with `part` in place of rows [start, end) along `axis`."""
    start, end = rows
    if (start, end) == (0, full.shape[axis]):
        return part
    pieces = [_rows(full, (0, start), axis)] if start else []
    pieces.append(part)
    if end < full.shape[axis]:
        pieces.append(_rows(full, (end, full.shape[axis]), axis))
    return paddle.concat(pieces, axis=axis)


def _pad_rows(part, rows, length, axis=1):
    start, end = rows
    if (start, end) == (0, length):
        return part
    shape = list(part.shape)
    pieces = []
    if start:
        shape[axis] = start
        pieces.append(paddle.zeros(shape, part.dtype))
    pieces.append(part)
    if end < length:
        shape[axis] = length - end
        pieces.append(paddle.zeros(shape, part.dtype))
    return paddle.concat(pieces, axis=axis)


def ring_forward(q, k, v, mesh_group, causal, scale, kernel):
    world, length = mesh_group.size, q.shape[1]
    kv = p2p.pack([k, v])
    out = lse = None
    for step in range(world):
        incoming = p2p.shift(mesh_group, kv, 1, op="ring") if step < world - 1 else None
        k_block, v_block = p2p.unpack(kv, [k, v])
        q_rows, k_rows, block_causal = block_plan(step, mesh_group.index, world, causal, length)
        block_out, block_lse = kernel.forward(
            _rows(q, q_rows), _rows(k_block, k_rows), _rows(v_block, k_rows), block_causal, scale
        )
        if out is None:
            out, lse = block_out, block_lse
        else:
            merged_out, merged_lse = merge(_rows(out, q_rows), _rows(lse, q_rows, 2), block_out, block_lse)
            out, lse = _write_rows(out, merged_out, q_rows, 1), _write_rows(lse, merged_lse, q_rows, 2)
        if incoming is not None:
            kv = incoming.wait()
    return out, lse


def ring_backward(dout, q, k, v, out, lse, mesh_group, causal, scale, kernel):
    world, length = mesh_group.size, q.shape[1]
    kv = p2p.pack([k, v])
    dq = None
    travelling = None  # dk/dv of the block held, on their way back to its owner
    for step in range(world):
        incoming = p2p.shift(mesh_group, kv, 1, op="ring") if step < world - 1 else None
        k_block, v_block = p2p.unpack(kv, [k, v])
        q_rows, k_rows, block_causal = block_plan(step, mesh_group.index, world, causal, length)
        dq_block, dk_block, dv_block = kernel.backward(
            _rows(dout, q_rows), _rows(q, q_rows), _rows(k_block, k_rows), _rows(v_block, k_rows),
            _rows(out, q_rows), _rows(lse, q_rows, 2), block_causal, scale,
        )
        dq_block = _pad_rows(dq_block, q_rows, length)
        dq = dq_block if dq is None else dq + dq_block
        dkv = p2p.pack([_pad_rows(dk_block, k_rows, length), _pad_rows(dv_block, k_rows, length)])
        if travelling is not None:
            dkv = dkv + travelling.wait()
        travelling = p2p.shift(mesh_group, dkv, 1, op="ring")
        if incoming is not None:
            kv = incoming.wait()
    dk, dv = p2p.unpack(travelling.wait(), [k, v])
    return dq, dk, dv


class RingAttention(PyLayer):
    @staticmethod
    def forward(ctx, q, k, v, mesh_group, causal, scale, kernel):
        out, lse = ring_forward(q, k, v, mesh_group, causal, scale, kernel)
        out = out.astype(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (mesh_group, causal, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensor()
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def ring_attention_local(q, k, v, mesh_group, causal, scale, kernel):
    """Ring attention over local [b, s_local, h, d] shards in the p2p layout."""
    if causal and q.shape[1] % 2:
        raise ValueError(
            f"causal ring attention needs an even local sequence (two balanced chunks), got {q.shape[1]}: "
            "split inputs with PrepareContextParallel('p2p') or paddle_cp.shard_sequence(..., backend='p2p')"
        )
    return RingAttention.apply(q, k, v, mesh_group, causal, scale, kernel)
