"""Attention kernels: `forward(q, k, v, mask, scale) -> (out, lse)` and its backward.

`mask` is a BlockMask (attention/masks/block_mask.py). `select_kernel` picks, for fp16/bf16
GPU tensors with one head dim for q/k/v, Paddle's flash-attention op when the
block, trimmed to what anyone sees, is all keys or plain causal, else its
flashmask op (a block cut by documents, windows or padding) when the build has
it and no dense mask applies; the blockwise fp32 kernel everywhere else. The
flash kernels make one op call per block (a ring step), the blockwise kernel
visits the tiles the block's row bounds say anyone sees.
"""
from __future__ import annotations

import numpy as np
from paddle.autograd import PyLayer

from ...dtypes import LOW_PRECISION
from ..masks.block_mask import BlockMask
from .blockwise import BlockwiseKernel
from .flash import FlashKernel, flash_available
from .flashmask import FlashMaskKernel, flashmask_available

def choose_kernel_name(on_gpu, dtype, has_flash, mask_fits_flash=True, same_head_dims=True, has_flashmask=False,
                       mask_fits_flashmask=True):
    """The dispatch rule, free of devices so it can be tested anywhere: for half-precision GPU tensors whose
    q/k/v share a head dim (not MLA), flash when the op exists and expresses the mask, else flashmask when
    that op exists and expresses it; blockwise otherwise."""
    if not (on_gpu and dtype in LOW_PRECISION and same_head_dims):
        return "blockwise"
    if has_flash and mask_fits_flash:
        return "flash"
    return "flashmask" if has_flashmask and mask_fits_flashmask else "blockwise"


_KERNELS = {"flash": FlashKernel, "flashmask": FlashMaskKernel, "blockwise": BlockwiseKernel}


def on_gpu(tensor):
    """Whether `tensor` lives on a GPU (the test suite substitutes this to run the GPU path on CPU)."""
    return not tensor.place.is_cpu_place()


def select_kernel(q, v, mask=None):
    gpu, has_flash, has_flashmask = on_gpu(q), flash_available(), flashmask_available()
    fits = mask is None or FlashKernel.supports(mask)
    fits_flashmask = mask is None or FlashMaskKernel.supports(mask)
    name = choose_kernel_name(gpu, q.dtype, has_flash, fits, q.shape[-1] == v.shape[-1], has_flashmask, fits_flashmask)
    return _KERNELS[name]()


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


__all__ = ["saveable", "BlockwiseKernel", "FlashKernel", "FlashMaskKernel", "select_kernel", "choose_kernel_name",
           "local_attention"]
