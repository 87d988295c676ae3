"""Attention kernels: `forward(q, k, v, mask, scale) -> (out, lse)` and its backward.

`mask` is a BlockMask (attention/mask.py). `select_kernel` picks Paddle's
flash-attention op for fp16/bf16 GPU tensors when the build has it and the mask
is one it can express, and the blockwise fp32 kernel everywhere else.
"""
from __future__ import annotations

import numpy as np
import paddle
from paddle.autograd import PyLayer

from ..mask import BlockMask
from .blockwise import BlockwiseKernel
from .flash import FlashKernel, flash_available

_HALF = (paddle.float16, paddle.bfloat16)


def choose_kernel_name(on_gpu, dtype, has_flash, mask_fits_flash=True, same_head_dims=True):
    """The dispatch rule, free of devices so it can be tested anywhere: flash for half-precision GPU
    tensors when the op exists, the mask is one it expresses and q/k/v share a head dim (not MLA)."""
    flash = on_gpu and has_flash and dtype in _HALF and mask_fits_flash and same_head_dims
    return "flash" if flash else "blockwise"


_KERNELS = {"flash": FlashKernel, "blockwise": BlockwiseKernel}


def on_gpu(tensor):
    """Whether `tensor` lives on a GPU (the test suite substitutes this to run the GPU path on CPU)."""
    return not tensor.place.is_cpu_place()


def select_kernel(q, v, mask=None):
    gpu, has_flash = on_gpu(q), flash_available()
    fits = mask is None or not (gpu and has_flash) or FlashKernel.supports(mask)
    return _KERNELS[choose_kernel_name(gpu, q.dtype, has_flash, fits, q.shape[-1] == v.shape[-1])]()


def saveable(*tensors):
    """The tensors, views (transpose, slice, unbind) copied into their own memory: a PyLayer
    saves the caller's tensors, and Paddle's non-reentrant recompute restores a saved view
    without its strides and offset."""
    return [t if t.is_contiguous() and t.offset == 0 else t.clone() for t in tensors]


class LocalAttention(PyLayer):
    """One process's attention through a kernel, differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, kernel):
        out, lse = kernel.forward(q, k, v, mask, scale)
        out, lse = saveable(out.astype(q.dtype), lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (mask, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensor()
        mask, scale, kernel = ctx.args
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, mask, scale)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def local_attention(q, k, v, causal, scale, kernel=None, mask=None):
    """Attention of one process's q over its k/v, at consecutive positions unless `mask` says otherwise."""
    if mask is None:
        mask = BlockMask(np.arange(q.shape[1]), np.arange(k.shape[1]), causal)
    q, k, v = saveable(q, k, v)
    return LocalAttention.apply(q, k, v, mask, scale, kernel or select_kernel(q, v, mask))


__all__ = ["saveable", "BlockwiseKernel", "FlashKernel", "select_kernel", "choose_kernel_name", "local_attention"]
