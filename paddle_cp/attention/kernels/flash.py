"""Paddle's flash-attention op (GPU, fp16/bf16); same interface as BlockwiseKernel.

One call per block (a ring step's queries x keys), as Paddle's own ring makes:
the block is trimmed to the rows and keys anyone sees (BlockMask.extent), and
flash_attn computes it when every trimmed row sees every key, or when it is
plain causal over identical positions; nothing runs for an empty block. A block
a document boundary, a window edge or padding cuts goes to the flashmask kernel
(flashmask.py, one call too), dense masks to the blockwise kernel (see
`expresses`), and so does MLA (v head dim != q/k head dim, which the v2
op refuses); the `flash_attn` op takes no sliding window. Attention sinks are
merged after any kernel (ring.py), so they need nothing here.

What the op returns and expects (Paddle 3.3.1 and the FlashAttention-2 fork it
loads; tests/workers/emulated_flash.py cites the source lines): out like q;
softmax_lse float32 holding [b, h, sq] packed at the start of its buffer, which
older Paddles shape [b, h, round_up(sq, 128)] (3.3.1's flash_attn_utils.h:
[b, h, sq]), so it is read flat, not sliced; flash_attn_grad reads it
the same way and needs a seed_offset tensor; causal is aligned top-left, and
only square blocks of identical positions are sent as causal, where top-left and
bottom-right agree. The test suite runs this file against that emulation on
CPU; it has never run against the real op on a GPU.
"""
from __future__ import annotations

import paddle
from paddle import _C_ops

from ... import runtime
from ...dtypes import LOW_PRECISION
from ..masks.block_mask import record_work

FP32 = paddle.float32


def on_gpu(tensor):
    """Whether `tensor` lives on a GPU (the test suite substitutes this to run the GPU path on CPU)."""
    return not tensor.place.is_cpu_place()


class FlashKernel:
    name = "flash"

    @classmethod
    def supports(cls, mask, q, v):
        """Whether this kernel runs the block: fp16/bf16 GPU tensors whose q/k/v share a head dim (the op refuses
        MLA), a build with the op, and a mask it expresses (any, when `mask` is None)."""
        return (on_gpu(q) and q.dtype in LOW_PRECISION and q.shape[-1] == v.shape[-1] and cls.available()
                and (mask is None or cls.expresses(mask)))

    @staticmethod
    def available():
        return flash_available()

    @staticmethod
    def expresses(mask):
        """Whether the block is empty, full or plain causal once trimmed: a sliding window that cuts it,
        padding, documents or a dense mask inside it need another kernel."""
        return mask.extent().kind in ("none", "all", "diagonal")

    def forward(self, q, k, v, mask, scale):
        """-> out [b, sq, hq, dv] fp32, lse [b, hq, sq] fp32; rows outside the extent: out 0, lse -inf."""
        b, sq, hq, _ = q.shape
        extent = mask.extent()
        record_work(extent.area, sq * k.shape[1])
        if extent.kind == "none":
            return paddle.zeros([b, sq, hq, v.shape[3]], FP32), paddle.full([b, hq, sq], float("-inf"), FP32)
        (r0, r1), (k0, k1) = extent.rows, extent.keys
        # the ops fix the softmax scale at 1/sqrt(d): fold any other scale into q.
        out, lse = self._call(_rescale(q[:, r0:r1], scale), k[:, k0:k1], v[:, k0:k1], mask, extent)
        return placed(out.astype(FP32), 1, r0, sq, 0.0), placed(lse, 2, r0, sq, float("-inf"))

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        extent = mask.extent()
        if extent.kind == "none":
            return tuple(paddle.zeros(x.shape, FP32) for x in (q, k, v))
        dtype, sq, sk = q.dtype, q.shape[1], k.shape[1]
        (r0, r1), (k0, k1) = extent.rows, extent.keys
        dq, dk, dv = self._call_grad(
            _rescale(q[:, r0:r1], scale), k[:, k0:k1], v[:, k0:k1], out[:, r0:r1].astype(dtype),
            lse[:, :, r0:r1].contiguous(), dout[:, r0:r1].astype(dtype), mask, extent)
        dq = placed(dq.astype(FP32), 1, r0, sq, 0.0)
        return _rescale(dq, scale), placed(dk.astype(FP32), 1, k0, sk, 0.0), placed(dv.astype(FP32), 1, k0, sk, 0.0)

    @staticmethod
    def _call(q, k, v, mask, extent):
        """(out, lse [b, h, Bq]) of a block that is all keys or causal on the diagonal."""
        if extent.kind == "some":
            raise ValueError("flash_attn takes blocks that are all keys or plain causal: this one needs flashmask")
        out, _, lse, _ = _C_ops.flash_attn(q, k, v, None, None, 0.0, extent.kind == "diagonal", False, False, "")
        return out, unpacked_lse(lse, q.shape[0], q.shape[2], q.shape[1])

    @staticmethod
    def _call_grad(q, k, v, out, lse, dout, mask, extent):
        return _C_ops.flash_attn_grad(q, k, v, out, lse, no_dropout_seed(), None, dout, 0.0, extent.kind == "diagonal")


def placed(x, axis, start, total, fill):
    """`x`, which covers [start, start + its length) of `total` along `axis`, with `fill` around it."""
    end = start + x.shape[axis]
    if start == 0 and end == total:
        return x
    parts = []
    for length in (start, None, total - end):
        if length is None:
            parts.append(x)
        elif length:
            shape = list(x.shape)
            shape[axis] = length
            parts.append(paddle.full(shape, fill, x.dtype))
    return paddle.concat(parts, axis=axis)


def unpacked_lse(lse, b, h, sq):
    """The op's lse buffer [b, h, round_up(sq, 128)] holds [b, h, sq] packed at its start."""
    return lse.reshape([-1])[: b * h * sq].reshape([b, h, sq])


def no_dropout_seed():
    """The (seed, offset) = (0, 0) the forward reports without dropout: an int64 [2] tensor, which
    flash_attn_grad requires (None is refused) and takes on the CPU (its kernel registration)."""
    if runtime.installed.no_dropout_seed is None:
        runtime.installed.no_dropout_seed = paddle.to_tensor([0, 0], dtype="int64", place=paddle.CPUPlace())
    return runtime.installed.no_dropout_seed


def _rescale(x, scale):
    default = x.shape[-1] ** -0.5
    return x if scale is None or abs(scale - default) < 1e-12 else x * (scale / default)


def flash_available():
    return paddle.is_compiled_with_cuda() and hasattr(_C_ops, "flash_attn")
