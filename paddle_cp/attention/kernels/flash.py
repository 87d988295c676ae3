"""Paddle's flash-attention op (GPU, fp16/bf16); same interface as BlockwiseKernel.

flash_attn knows only "all keys" and "causal on the diagonal", so the BlockMask
is cut into runs of consecutive positions and each pair of runs is one call,
merged by log-sum-exp. Tiles a document boundary, a window edge or padding cuts
go to the flashmask kernel (flashmask.py, which runs the others here), dense
masks to the blockwise kernel (see `supports`), and so does MLA (v head dim != q/k head dim, which the v2
op refuses); the `flash_attn` op takes no sliding window. Attention sinks are
merged after any kernel (ring.py), so they need nothing here.

What the op returns and expects (Paddle 3.3.1 and the FlashAttention-2 fork it
loads; tests/workers/emulated_flash.py cites the source lines): out like q;
softmax_lse float32 holding [b, h, sq] packed at the start of its buffer, which
older Paddles shape [b, h, round_up(sq, 128)] (3.3.1's flash_attn_utils.h:
[b, h, sq]), so it is read flat, not sliced; flash_attn_grad reads it
the same way and needs a seed_offset tensor; causal is aligned top-left, and
only square pairs of identical positions are sent as causal, where top-left and
bottom-right agree. The test suite runs this file against that emulation on
CPU; it has never run against the real op on a GPU.
"""
from __future__ import annotations

import paddle
from paddle import _C_ops

from ..merge import merge


class FlashKernel:
    @staticmethod
    def supports(mask):
        """Whether every tile is empty, full or plain causal: a sliding window that cuts a tile,
        padding, documents or a dense mask inside a tile need another kernel."""
        return all(mask.classify(qr, kr) in ("none", "all", "diagonal") for qr in mask.q_runs() for kr in mask.k_runs())

    @staticmethod
    def _ranges(mask):
        """(query ranges, key ranges) one call each: runs of consecutive positions."""
        return mask.q_runs(), mask.k_runs()

    def _pairs(self, mask, record):
        """(q range, [(k range, kind), ...]) for each query range, the ranges its queries see nothing of left out."""
        q_ranges, k_ranges = self._ranges(mask)
        for qr in q_ranges:
            seen = [(kr, mask.classify(qr, kr, record)) for kr in k_ranges]
            yield qr, [(kr, kind) for kr, kind in seen if kind != "none"]

    def forward(self, q, k, v, mask, scale):
        b, _, hq, d = q.shape
        # the ops fix the softmax scale at 1/sqrt(d): fold any other scale into q.
        q = _rescale(q, scale)
        outs, lses = [], []
        for (qs, qe), seen in self._pairs(mask, record=True):
            out = lse = None
            for (ks, ke), kind in seen:
                block_out, block_lse = self._tile_forward(
                    q[:, qs:qe], k[:, ks:ke], v[:, ks:ke], mask, (qs, qe), (ks, ke), kind)
                out, lse = merge(out, lse, block_out.astype(paddle.float32), block_lse)
            if out is None:  # these queries see no key here
                out = paddle.zeros([b, qe - qs, hq, d], paddle.float32)
                lse = paddle.full([b, hq, qe - qs], float("-inf"), paddle.float32)
            outs.append(out)
            lses.append(lse)
        return paddle.concat(outs, axis=1), paddle.concat(lses, axis=2)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        dtype = q.dtype
        scaled = _rescale(q, scale)
        dq = paddle.zeros(q.shape, paddle.float32)
        dk = paddle.zeros(k.shape, paddle.float32)
        dv = paddle.zeros(v.shape, paddle.float32)
        for (qs, qe), seen in self._pairs(mask, record=False):
            for (ks, ke), kind in seen:
                dq_b, dk_b, dv_b = self._tile_backward(
                    scaled[:, qs:qe], k[:, ks:ke], v[:, ks:ke], out[:, qs:qe].astype(dtype),
                    lse[:, :, qs:qe].contiguous(), dout[:, qs:qe].astype(dtype), mask, (qs, qe), (ks, ke), kind)
                dq[:, qs:qe] += dq_b.astype(paddle.float32)
                dk[:, ks:ke] += dk_b.astype(paddle.float32)
                dv[:, ks:ke] += dv_b.astype(paddle.float32)
        return _rescale(dq, scale), dk, dv

    @staticmethod
    def _tile_forward(q, k, v, mask, q_range, k_range, kind):
        """(out, lse [b, h, Bq]) of one tile that is all keys or causal on the diagonal."""
        out, _, lse, _ = _C_ops.flash_attn(q, k, v, None, None, 0.0, kind == "diagonal", False, False, "")
        return out, unpacked_lse(lse, q.shape[0], q.shape[2], q.shape[1])

    @staticmethod
    def _tile_backward(q, k, v, out, lse, dout, mask, q_range, k_range, kind):
        return _C_ops.flash_attn_grad(q, k, v, out, lse, no_dropout_seed(), None, dout, 0.0, kind == "diagonal")


def unpacked_lse(lse, b, h, sq):
    """The op's lse buffer [b, h, round_up(sq, 128)] holds [b, h, sq] packed at its start."""
    return lse.reshape([-1])[: b * h * sq].reshape([b, h, sq])


_seed = []


def no_dropout_seed():
    """The (seed, offset) = (0, 0) the forward reports without dropout: an int64 [2] tensor, which
    flash_attn_grad requires (None is refused) and takes on the CPU (its kernel registration)."""
    if not _seed:
        _seed.append(paddle.to_tensor([0, 0], dtype="int64", place=paddle.CPUPlace()))
    return _seed[0]


def _rescale(x, scale):
    default = x.shape[-1] ** -0.5
    return x if scale is None or abs(scale - default) < 1e-12 else x * (scale / default)


def flash_available():
    return paddle.is_compiled_with_cuda() and hasattr(_C_ops, "flash_attn")
