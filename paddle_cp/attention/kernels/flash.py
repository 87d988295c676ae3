"""Paddle's flash-attention op (GPU, fp16/bf16); same interface as BlockwiseKernel.

Not runnable on the CPU machines this project is tested on: only its selection
logic is tested there (see kernels.select_kernel).
"""
from __future__ import annotations

import paddle
from paddle import _C_ops


class FlashKernel:
    name = "flash"

    def forward(self, q, k, v, causal, scale):
        # flash_attn fixes the softmax scale at 1/sqrt(d): fold any other scale into q.
        q = _rescale(q, scale)
        out, _, lse, _ = _C_ops.flash_attn(q, k, v, None, None, 0.0, causal, False, False, "")
        return out.astype(paddle.float32), lse.astype(paddle.float32)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dtype = q.dtype
        scaled = _rescale(q, scale)
        dq, dk, dv = _C_ops.flash_attn_grad(
            scaled, k, v, out.astype(dtype), lse, None, None, dout.astype(dtype), 0.0, causal
        )
        dq = _rescale(dq.astype(paddle.float32), scale)
        return dq, dk.astype(paddle.float32), dv.astype(paddle.float32)


def _rescale(x, scale):
    default = x.shape[-1] ** -0.5
    return x if scale is None or abs(scale - default) < 1e-12 else x * (scale / default)


def flash_available():
    return paddle.is_compiled_with_cuda() and hasattr(_C_ops, "flash_attn")
