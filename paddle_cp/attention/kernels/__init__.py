"""Attention kernels: `forward(q, k, v, causal, scale) -> (out, lse)` and its backward.

`select_kernel` picks Paddle's flash-attention op for fp16/bf16 GPU tensors when
the build has it, and the blockwise fp32 kernel everywhere else.
"""
from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from .blockwise import BlockwiseKernel
from .flash import FlashKernel, flash_available

_HALF = (paddle.float16, paddle.bfloat16)


def choose_kernel_name(on_gpu, dtype, has_flash):
    """The dispatch rule, free of devices so it can be tested anywhere."""
    return "flash" if on_gpu and has_flash and dtype in _HALF else "blockwise"


_KERNELS = {"flash": FlashKernel, "blockwise": BlockwiseKernel}


def select_kernel(q):
    name = choose_kernel_name(not q.place.is_cpu_place(), q.dtype, flash_available())
    return _KERNELS[name]()


class LocalAttention(PyLayer):
    """One process's attention through a kernel, differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel):
        out, lse = kernel.forward(q, k, v, causal, scale)
        out = out.astype(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensor()
        causal, scale, kernel = ctx.args
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, scale)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def local_attention(q, k, v, causal, scale, kernel=None):
    return LocalAttention.apply(q, k, v, causal, scale, kernel or select_kernel(q))


__all__ = ["BlockwiseKernel", "FlashKernel", "select_kernel", "choose_kernel_name", "local_attention"]
