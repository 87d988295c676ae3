"""Paddle's flashmask_attention op (GPU, fp16/bf16) for the blocks flash_attn cannot express.

A block cut by document boundaries, a sliding-window edge or padding keys is,
for every key, one range of the block's query rows that see it (query positions
ascend; BlockMask's row bounds). flashmask_attention takes exactly that, per batch
row and key, so such a block (a whole ring step, any number of documents) is one
call, its row indices made on the device once per batch (BlockMask.row_indices);
blocks that are all keys or plain causal once trimmed go to flash_attn
(FlashKernel, whose trimming this kernel shares). Dense masks are not ranges of
rows and stay with the blockwise kernel.

The op's contract, read from Paddle 3.3.1 (python/paddle/nn/functional/
flash_attention.py `flashmask_attention`; paddle/phi/kernels/gpu/
flash_attn_kernel.cu `FlashMaskKernel`, which is `FlashAttnBaseKernel` with
the row indices, as `FlashMaskGradKernel` is `FlashAttnGradBaseKernel`) and the
FlashAttention-2 fork it loads (PaddlePaddle/flash-attention at 9985af5):

- `_C_ops.flashmask_attention(q, k, v, startend_row_indices, fixed_seed_offset,
  dropout, causal, return_softmax, is_test, rng_name) -> (out, softmax,
  softmax_lse, seed_offset)`; `_C_ops.flashmask_attention_grad(q, k, v,
  startend_row_indices, out, softmax_lse, seed_offset, out_grad, dropout,
  causal) -> (dq, dk, dv)`, `seed_offset` a required Tensor (the binding
  raises on None; checked on this wheel). The python wrapper adds nothing for
  FlashAttention 2 but asserts (int32, rank 4, batch and key length matching).
- q/k/v/out as flash_attn's: [b, s, h, d], GQA by head groups, softmax scale
  fixed at 1/sqrt(d) (FlashAttnBaseKernel: `softmax_scale = 1.0f /
  std::sqrt(head_size)`), softmax_lse float32 holding [b, h, sq] packed at the
  start of its buffer (flash_fwd_kernel.h, compute_attn_1rowblock_flashmask:
  `row_offset_lse = (bidb * params.h + bidh) * params.seqlen_q + m_block *
  kBlockM`), which the grad kernel reads the same way.
- `startend_row_indices` int32 [b, 1 | h_k | h, sk, 1 | 2 | 4]; with
  causal=False and 2 bounds, key column j is masked for rows >= [..., j, 0]
  and rows < [..., j, 1] (softmax.h `apply_sparse_mask`, pairwise=false:
  `row_idx >= startrow` or `row_idx < endrow`), rows counted from the op's
  first query and compared as uint32. So non-causal with (end, start) of the
  rows that see j expresses any such range; causal=True would add the
  kernel's top-left triangle (`col_idx_limit = min(max_seqlen_k, row_idx +
  1)`), which tiles from two ring members do not share, so it is never used.
- A row that sees no key gets out 0 and lse +inf (`lse = sum == 0 ? INFINITY
  : ...`); paddle_cp's merge marks "saw nothing" with -inf, so the forward
  turns +inf into -inf and the backward hands the op +inf for rows whose final
  lse is -inf (exp(s - lse) must be 0 there, not NaN).
- On sm90 with FLAGS_flash_attn_version=3 and head dim 64/128/256 the base
  kernel throws ("FlashMask or Dense Mask is unsupported in FlashAttention
  V3"): `flashmask_available` is False under that flag.

The test suite runs this file against an emulation of that contract on CPU
(tests/workers/emulated_flash.py); it has never run against the real op on a GPU.
"""
from __future__ import annotations

import paddle
from paddle import _C_ops

from .flash import FlashKernel, flash_available, no_dropout_seed, unpacked_lse


class FlashMaskKernel(FlashKernel):
    name = "flashmask"

    @staticmethod
    def available():
        return flashmask_available()

    @staticmethod
    def expresses(mask):
        """Every tile is a range of rows per key except under a dense mask."""
        return mask.dense is None

    def _call(self, q, k, v, mask, extent):
        if extent.kind != "some":
            return super()._call(q, k, v, mask, extent)
        out, _, lse, _ = _C_ops.flashmask_attention(q, k, v, mask.row_indices(q.shape[0]), None, 0.0, False, False,
                                                    False, "")
        lse = unpacked_lse(lse, q.shape[0], q.shape[2], q.shape[1])
        return out, paddle.where(paddle.isinf(lse), paddle.full([], float("-inf"), lse.dtype), lse)

    def _call_grad(self, q, k, v, out, lse, dout, mask, extent):
        if extent.kind != "some":
            return super()._call_grad(q, k, v, out, lse, dout, mask, extent)
        lse = paddle.where(paddle.isinf(lse), paddle.full([], float("inf"), lse.dtype), lse)
        return _C_ops.flashmask_attention_grad(q, k, v, mask.row_indices(q.shape[0]), out, lse, no_dropout_seed(),
                                               dout, 0.0, False)


def flashmask_available():
    if not (flash_available() and hasattr(_C_ops, "flashmask_attention")):
        return False
    return paddle.get_flags(["FLAGS_flash_attn_version"])["FLAGS_flash_attn_version"] != 3
