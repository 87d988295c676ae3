"""Attention kernels: `forward(q, k, v, mask, scale) -> (out, lse)` and its backward.

`mask` is a BlockMask (attention/masks/block_mask.py). `select_kernel` takes the first kernel of
KERNELS whose `supports(mask, q, v)` says it runs the block: Paddle's flash-attention op for fp16/bf16 GPU
tensors with one head dim for q/k/v when the block, trimmed to what anyone sees, is all keys or plain
causal; else its flashmask op (a block cut by documents, windows or padding) when the build has it and no
dense mask applies; the blockwise fp32 kernel everywhere else. A new kernel is a class with `supports` and
`forward`/`backward`, placed in KERNELS before those it should win over. The flash kernels make one op call
per block (a ring step), the blockwise kernel visits the tiles the block's row bounds say anyone sees.
"""
from __future__ import annotations

import numpy as np
from paddle.autograd import PyLayer

from ..masks.block_mask import BlockMask
from .blockwise import BlockwiseKernel
from .flash import FlashKernel
from .flashmask import FlashMaskKernel

KERNELS = (FlashKernel, FlashMaskKernel, BlockwiseKernel)  # in order of preference: the first that runs a block


def select_kernel(q, v, mask=None):
    """An instance of the first kernel in KERNELS that runs attention of `q` (and v's head dim) over `mask`."""
    return next(kernel for kernel in KERNELS if kernel.supports(mask, q, v))()


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


__all__ = ["saveable", "BlockwiseKernel", "FlashKernel", "FlashMaskKernel", "KERNELS", "select_kernel",
           "local_attention"]
