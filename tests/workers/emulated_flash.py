"""Paddle's GPU `flash_attn` / `flash_attn_grad` ops, emulated on CPU for tests.

Written from Paddle 3.3.1's kernels and the FlashAttention-2 fork they load
(PaddlePaddle/flash-attention at 9985af5); every fact carries its source:

- Signature (python binding, checked on this wheel): flash_attn(q, k, v,
  fixed_seed_offset, attn_mask, dropout, causal, return_softmax, is_test,
  rng_name) -> (out, softmax, softmax_lse, seed_offset); flash_attn_grad(q, k,
  v, out, softmax_lse, seed_offset, attn_mask, out_grad, dropout, causal) ->
  (dq, dk, dv). `seed_offset` is a required Tensor: the binding raises
  ValueError on None (eager_utils.cc:1512, reproduced below).
- Kernels registered for float16/bfloat16 only (flash_attn_kernel.cu,
  PD_REGISTER_KERNEL(flash_attn, GPU, ...)).
- Layout q [b, sq, hq, d], k/v [b, sk, hk, d], out like q in q's dtype
  (FlashAttnBaseKernel: "q, k, v [batch_size, seq_len, num_heads, head_dim]").
- Softmax scale fixed at 1/sqrt(d) (FlashAttnBaseKernel: `softmax_scale =
  1.0f / std::sqrt(head_size)`); no scale argument.
- GQA: q head h reads k/v head h // (hq / hk) (flash_fwd_kernel.h: `bidh /
  params.h_h_k_ratio`); hq % hk == 0, d % 8 == 0, d <= 256 (capi/flash_attn.cu
  CHECK_FWD_EXECTUABLE). The grad kernel computes dk/dv per q head in the
  input dtype, then sums each group in that dtype (flash_attn_grad_kernel.cu:
  dk_tmp [total_k, hk, hq/hk, d], then SumKernel over dim 2).
- Causal is TOP-LEFT aligned when sq != sk: query row i sees keys j <= i
  (softmax.h:159 `col_idx_limit = std::min(max_seqlen_k, row_idx + 1)`;
  flash_fwd_kernel.h:149 `n_block_max = min(n_block_max, ceil_div((m_block + 1)
  * kBlockM, kBlockN))`). (Upstream FlashAttention >= 2.1 aligns bottom-right;
  Paddle's fork does not.)
- softmax_lse: float32, shape [b, hq, round_up(sq, 128)] (flash_attn_utils.h:
  `seqlen_q_rounded = round_multiple(max_seqlen_q, kBlockM)`, kBlockM = 128
  forward, `softmax_lse_dims = {batch_size, num_heads, seqlen_q_rounded}`), but
  the kernel writes it PACKED as [b, hq, sq] at the start of that buffer
  (flash_fwd_kernel.h:539 `row_offset_lse = (bidb * params.h + bidh) *
  params.seqlen_q + m_block * kBlockM`, capi/flash_attn.cu:677 unpadded_lse =
  false) and the grad kernel reads it the same way (flash_bwd_kernel.h:468).
  So lse[:, :, :sq] is right only when b * hq == 1 or sq % 128 == 0; the tail
  is never written: the emulation fills it with NaN so a wrong read shows.
  A row that sees no key gets lse +inf and out 0 (flash_fwd_kernel.h:514).
- seed_offset: int64 [2] = (0, 0) when dropout == 0 (flash_attn_utils.h,
  FlashAttnFwdParamsV2); the grad kernel reads it as int64 on the host
  (`seed_offset.data<int64_t>()`; flash_attn_grad_kernel.cu registers
  `InputAt(5).SetBackend(phi::Backend::CPU)`).
- Rounding: scores and softmax in fp32; P is converted to the input dtype
  before P @ V (flash_fwd_kernel.h:413 `rP = convert_type<Element>(scores)`),
  accumulated in fp32, normalised, and the output converted (line 523). The
  backward converts P and dS before its matmuls (flash_bwd_kernel.h:862, 936).
  CPU Paddle has no bf16 matmul, so every product runs in fp32 on values
  rounded to the dtype exactly where the GPU kernel rounds them; only the
  kernel's tile-by-tile running maximum is replaced by the row maximum.
Not emulated (refused): dropout > 0, attn_mask, return_softmax, FlashAttention-3
(FLAGS_flash_attn_version=3 on sm90 with d in {64, 128, 256}).

`flashmask_attention` / `flashmask_attention_grad` (paddle_cp/attention/kernels/
flashmask.py cites the same sources at length): FlashMaskKernel and
FlashMaskGradKernel are flash_attn's base kernels given `startend_row_indices`,
so everything above holds, plus:
- Signature: flashmask_attention(q, k, v, startend_row_indices,
  fixed_seed_offset, dropout, causal, return_softmax, is_test, rng_name) ->
  (out, softmax, softmax_lse, seed_offset); flashmask_attention_grad(q, k, v,
  startend_row_indices, out, softmax_lse, seed_offset, out_grad, dropout,
  causal) -> (dq, dk, dv); seed_offset (position 6) a required Tensor
  (the binding's ValueError, checked on this wheel).
- startend_row_indices: int32, rank 4, [b, 1 | hk | hq, sk, n] (python wrapper
  asserts); mask head h' serves q head h = h' * (hq / heads) + ... (`bidh /
  params.h_h_sparsemask_ratio`). causal=False, n = 2: column j masked for rows
  >= [.., j, 0] and rows < [.., j, 1], compared as uint32 (softmax.h
  apply_sparse_mask, pairwise=false). Only that form is emulated.
- softmax_lse: 3.3.1's shipped flash_attn_utils.h sizes it [b, h, sq]
  (`softmax_lse_dims = {batch_size, num_heads, max_seqlen_q}`), the fork's
  kernel writes it packed (compute_attn_1rowblock_flashmask, `row_offset_lse`):
  emulated exactly so. A row that sees no key: out 0, lse +inf.
"""
from __future__ import annotations

import math

import numpy as np
import paddle

FP32 = paddle.float32
LSE_ROWS = 128  # kBlockM of the forward kernel
HALF = (paddle.float16, paddle.bfloat16)
# What tests allow between two correct half-precision computations, relative to the values'
# largest magnitude: ~5 bf16 ulps (2^-8 each), ~8 fp16 ulps (2^-11 each).
RELATIVE_TOLERANCE = {paddle.bfloat16: 0.02, paddle.float16: 0.004}


def _round(x, dtype):
    """fp32 values rounded to `dtype` (where the GPU kernel converts)."""
    return x.astype(dtype).astype(FP32)


def _check(q, k, v, dropout, attn_mask):
    if q.dtype not in HALF:
        raise RuntimeError(f"(NotFound) The kernel `flash_attn` with dtype {q.dtype} is not registered.")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError("flash_attn: q, k and v must share a dtype")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("flash_attn receive input with dim [batch_size, seq_len, num_heads, head_dim]")
    d, hq, hk = q.shape[3], q.shape[2], k.shape[2]
    if d % 8 or d > 256 or hq % hk or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"flash_attn: unsupported shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if dropout or attn_mask is not None:
        raise NotImplementedError("the emulation covers dropout 0 without attn_mask (what paddle_cp calls)")


def _heads_first(x, repeat=1):
    """[b, s, h, d] -> fp32 [b, h * repeat, s, d]; GQA: each k/v head serves `repeat` q heads."""
    x = x.astype(FP32).transpose([0, 2, 1, 3])
    return x.repeat_interleave(repeat, axis=1) if repeat > 1 else x


def _scores(q, k, causal, seen=None):
    """fp32 scores [b, hq, sq, sk] at the op's fixed scale 1/sqrt(d); masked ones -inf.
    `seen`: bool [b, hq, sq, sk] of pairs a flashmask leaves visible."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    s = paddle.matmul(_heads_first(q), _heads_first(k, q.shape[2] // k.shape[2]), transpose_y=True)
    s = s * (1.0 / math.sqrt(d))
    if causal:  # top-left: row i sees keys j <= i
        seen = paddle.arange(sk)[None, :] <= paddle.arange(sq)[:, None]
        s = paddle.where(seen, s, paddle.full([], float("-inf"), FP32))
    elif seen is not None:
        s = paddle.where(paddle.to_tensor(seen), s, paddle.full([], float("-inf"), FP32))
    return s


def _exp(x):
    """exp with exp(-inf) = 0 exactly, as on the GPU (Paddle's CPU exp(-inf) is ~1e-37)."""
    return paddle.where(paddle.isinf(x) & (x < 0), paddle.zeros_like(x), paddle.exp(x))


def _packed_lse(lse, sq):
    """[b, h, sq] -> the op's [b, h, round_up(sq, 128)] buffer: values packed first, tail never written (NaN)."""
    b, h, _ = lse.shape
    rounded = -(-sq // LSE_ROWS) * LSE_ROWS
    tail = paddle.full([b * h * (rounded - sq)], float("nan"), FP32)
    return paddle.concat([lse.reshape([-1]), tail]).reshape([b, h, rounded])


def _read_lse(lse, b, h, sq):
    """What the grad kernel reads: the first b*h*sq floats of the buffer, as [b, h, sq]."""
    if lse.dtype != FP32 or lse.numel() < b * h * sq:
        raise ValueError(f"flash_attn_grad: softmax_lse must be float32 with at least {b * h * sq} values")
    return lse.contiguous().reshape([-1])[: b * h * sq].reshape([b, h, sq])


def flash_attn(q, k, v, fixed_seed_offset, attn_mask, dropout, causal, return_softmax, is_test, rng_name):
    _check(q, k, v, dropout, attn_mask)
    if return_softmax:
        raise ValueError("return_softmax is only supported when dropout > 0.0")
    out, lse = _forward(q, k, v, _scores(q, k, causal))
    return out, paddle.empty([0], q.dtype), _packed_lse(lse, q.shape[1]), paddle.zeros([2], "int64")


def _forward(q, k, v, s):
    """(out like q, lse [b, hq, sq]) from the masked scores s [b, hq, sq, sk]."""
    hq = q.shape[2]
    m = s.max(axis=-1, keepdim=True)
    empty = paddle.isinf(m)  # a row that sees no key
    p = _exp(s - paddle.where(empty, paddle.zeros_like(m), m))
    total = p.sum(axis=-1, keepdim=True)
    acc = paddle.matmul(_round(p, q.dtype), _heads_first(v, hq // k.shape[2]))  # [b, hq, sq, d]
    out = paddle.where(empty, paddle.zeros_like(acc), acc / paddle.where(empty, paddle.ones_like(total), total))
    lse = paddle.where(empty, paddle.full([], float("inf"), FP32), m + paddle.log(total)).squeeze(-1)
    return out.transpose([0, 2, 1, 3]).astype(q.dtype), lse


def _check_seed_offset(seed_offset, op, position):
    if not isinstance(seed_offset, paddle.Tensor):
        raise ValueError(f"(InvalidArgument) {op}(): argument 'seed_offset' (position {position}) must be Tensor, "
                         f"but got {type(seed_offset).__name__}")
    if seed_offset.dtype != paddle.int64 or seed_offset.shape != [2]:
        raise ValueError(f"{op}: seed_offset must be int64 [2], got {seed_offset.dtype} {seed_offset.shape}")


def flash_attn_grad(q, k, v, out, softmax_lse, seed_offset, attn_mask, out_grad, dropout, causal):
    _check_seed_offset(seed_offset, "flash_attn_grad", 5)
    _check(q, k, v, dropout, attn_mask)
    return _backward(q, k, v, out, softmax_lse, out_grad, _scores(q, k, causal))


def _backward(q, k, v, out, softmax_lse, out_grad, s):
    """(dq, dk, dv) in q's dtype from the masked scores s [b, hq, sq, sk] and the op's lse buffer."""
    dtype, (b, sq, hq, d), hk = q.dtype, q.shape, k.shape[2]
    group = hq // hk
    lse = _read_lse(softmax_lse, b, hq, sq)
    p = _exp(s - lse.unsqueeze(-1))  # [b, hq, sq, sk]
    do, o = _heads_first(out_grad), _heads_first(out)
    delta = (do * o).sum(axis=-1, keepdim=True)
    dp = paddle.matmul(do, _heads_first(v, group), transpose_y=True)
    ds = _round(p * (dp - delta), dtype)
    scale = 1.0 / math.sqrt(d)
    dq = paddle.matmul(ds, _heads_first(k, group)) * scale
    dk = _round(paddle.matmul(ds, _heads_first(q), transpose_x=True) * scale, dtype)  # per q head
    dv = _round(paddle.matmul(_round(p, dtype), do, transpose_x=True), dtype)

    def per_kv_head(x):  # [b, hq, sk, d] -> [b, sk, hk, d], each GQA group summed (in the dtype)
        return x.reshape([b, hk, group, x.shape[2], d]).sum(axis=2).transpose([0, 2, 1, 3]).astype(dtype)

    return dq.transpose([0, 2, 1, 3]).astype(dtype), per_kv_head(dk), per_kv_head(dv)


def _flashmask_seen(q, k, startend_row_indices, causal):
    """bool [b, hq, sq, sk]: the pairs a non-causal two-bound flashmask leaves visible."""
    (b, sq, hq, _), (sk, hk) = q.shape, k.shape[1:3]
    rows = startend_row_indices
    if rows.dtype != paddle.int32 or rows.ndim != 4 or rows.shape[0] != b or rows.shape[2] != sk:
        raise ValueError(f"flashmask_attention: startend_row_indices must be int32 [{b}, heads, {sk}, bounds], "
                         f"got {rows.dtype} {rows.shape}")
    if rows.shape[1] not in (1, hk, hq):
        raise ValueError("startend_row_indices head_num must be equal to 1(broadcast) or head_num_q or head_num_k.")
    if causal or rows.shape[3] != 2:
        raise NotImplementedError("the emulation covers causal=False with two bounds per key (what paddle_cp calls)")
    bounds = rows.numpy().astype(np.uint32)  # the kernel compares rows as uint32
    down_start, up_end = bounds[..., 0][:, :, None, :], bounds[..., 1][:, :, None, :]  # [b, heads, 1, sk]
    row = np.arange(sq, dtype=np.uint32)[None, None, :, None]
    seen = ~((row >= down_start) | (row < up_end))
    return np.repeat(seen, hq // rows.shape[1], axis=1)  # mask head h' serves q heads h' * ratio ...


def flashmask_attention(q, k, v, startend_row_indices, fixed_seed_offset, dropout, causal, return_softmax, is_test,
                        rng_name):
    _check(q, k, v, dropout, None)
    if return_softmax:
        raise ValueError("return_softmax is only supported when dropout > 0.0")
    seen = _flashmask_seen(q, k, startend_row_indices, causal)
    out, lse = _forward(q, k, v, _scores(q, k, False, seen))
    return out, paddle.empty([0], q.dtype), lse, paddle.zeros([2], "int64")


def flashmask_attention_grad(q, k, v, startend_row_indices, out, softmax_lse, seed_offset, out_grad, dropout, causal):
    _check_seed_offset(seed_offset, "flashmask_attention_grad", 6)
    _check(q, k, v, dropout, None)
    seen = _flashmask_seen(q, k, startend_row_indices, causal)
    return _backward(q, k, v, out, softmax_lse, out_grad, _scores(q, k, False, seen))


def install(set_attr=setattr):
    """Make paddle_cp take its GPU path on CPU tensors: flash and flashmask kernels selected, ops emulated.
    `set_attr`: pytest's monkeypatch.setattr to undo it after a test."""
    from paddle import _C_ops

    from paddle_cp.attention.kernels import flash, flashmask

    set_attr(_C_ops, "flash_attn", flash_attn)
    set_attr(_C_ops, "flash_attn_grad", flash_attn_grad)
    set_attr(_C_ops, "flashmask_attention", flashmask_attention)
    set_attr(_C_ops, "flashmask_attention_grad", flashmask_attention_grad)
    set_attr(flash, "on_gpu", lambda tensor: True)
    set_attr(flash, "flash_available", lambda: True)
    set_attr(flashmask, "flashmask_available", lambda: True)
