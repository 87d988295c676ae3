"""A vision tower's activations, FLOPs and attention tiles over a list of media (pure functions, no Paddle).

Held from the tower's forward to its backward, bytes per patch (P patches, hidden C, intermediate I, `elem` bytes an
element). Measured on CPU in fp32 with Paddle's allocator statistics (PaddleFormers 1.2.0's Qwen2.5-VL tower,
eager attention, towers of 0, 1 and 2 blocks at three (C, I, heads) and two window sizes: exact to the byte;
`pcp-memory --vision-language` checks the whole step). Which of those tensors are fp32 below fp32 is read from the
model's code (its RMSNorm and vision RoPE cast to fp32), not measured (the CPU build has no bf16 matmul):

- a block: two RMSNorms (each rms_norm_kept, its fp32 inverse rms unfused, and its output); RoPE's q and k and their
  rotated halves (4 C, fp32: apply_rotary_pos_emb_vision casts); attention's 4 C (q, k, v per call and k's
  transpose under eager; flash keeps q, k, v and its output) and the kernel's own: eager the [heads, L, L] fp32
  probabilities of each call of L patches (and their cast below fp32), flash an fp32 log-sum-exp per head (from
  the kernel's contract, not measured); the output projection's input (C); the SwiGLU MLP's gate, up, activation
  and product (4 I). Under full recomputation a block keeps its input alone (C; measured) and one block is rebuilt
  in backward.
- outside the blocks: the rotary tables cos and sin (2 x head_dim, fp32, once); the pixel rows the patch embedding
  reads when they are a copy of the batch's (`own_pixels`: the model's cast below fp32, or the split's selection of
  a rank's pieces; patch_pixels x elem; measured in fp32 for the split); the merger's RMSNorm, its GELU's input and
  output (2 C), the window order and its inverse (an int64 each per token).

Attention is called per window (windowed blocks: windows of window_side^2 patches, fewer at the frame's edges, as
get_window_index cuts them) or per temporal patch (full blocks: h x w patches), never across two: each call a
causal-free block of L patches priced by the GPU tile model (cost/tiles.py, the H200 fit, heads x head_dim over the
fit's 32 x 128), ceil(L/128)^2 tiles of which (L // 128)^2 full, the rest partial; plus the fit's fixed cost once
per block (one variable-length kernel call forward and backward). PaddleFormers' code calls the kernel once per
window in a Python loop: `attention_calls` counts those launches (not priced).
"""
from __future__ import annotations

import numpy as np

from .attention import FP32
from .rms_norm import rms_norm_kept
from .tiles import FIT_HEAD_DIM, FIT_HEADS, FULL_MS, PARTIAL_MS, RANK_MS, TILE

KERNELS = ("flash", "eager")  # the vision attention's kernel: GPU flash, or PaddleFormers' eager ops (CPU)
INDEX = 8  # an int64 index
ROPE_TENSORS = 4  # q, k and their rotated halves
ATTENTION_TENSORS = 4  # q, k, v and k's transpose (eager) or the output (flash)
MLP_TENSORS = 4  # gate, up, activation, product
MERGER_TENSORS = 2  # the merger's GELU input and output, [P / merge^2, merge^2 C]


def window_lengths(vision, item):
    """Patches of each windowed attention call over one image or video, as get_window_index cuts its frames."""
    side = vision.window_side // vision.merge  # in merged tokens
    rows, cols = item.h // vision.merge, item.w // vision.merge
    heights = np.minimum(side, rows - np.arange(0, rows, side))
    widths = np.minimum(side, cols - np.arange(0, cols, side))
    per_frame = (heights[:, None] * widths[None, :]).ravel() * vision.merge_unit
    return np.tile(per_frame, item.t)


def attention_lengths(vision, media, full):
    """int64 [calls]: patches of each attention call of a full (True) or windowed block over `media`."""
    parts = [np.full(item.t, item.frame_patches) if full else window_lengths(vision, item) for item in media]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def block_kinds(vision):
    """[(full, blocks of that kind)]: the full-attention blocks and the windowed ones."""
    windowed = vision.windowed_blocks
    return [(True, vision.depth - windowed), (False, windowed)]


def _norm(vision, patches, elem, fused):
    """An RMSNorm's held bytes over `patches`; unfused also its fp32 inverse rms (measured; the decoder's count
    leaves those 4 bytes a token out)."""
    return patches * (rms_norm_kept(vision.hidden, elem, fused) + (0 if fused else FP32) + vision.hidden * elem)


def kernel_bytes(vision, lengths, elem, kernel):
    """What the attention kernel itself keeps over calls of `lengths` patches: flash an fp32 log-sum-exp per head
    and patch; eager each call's [heads, L, L] fp32 probabilities (and their cast to `elem` below fp32)."""
    if kernel == "flash":
        return int(lengths.sum()) * vision.heads * FP32
    if kernel == "eager":
        return int((lengths * lengths).sum()) * vision.heads * (FP32 + (elem if elem < FP32 else 0))
    raise ValueError(f"unknown vision attention kernel {kernel!r}: use one of {KERNELS}")


def block_bytes(vision, media, full, elem, fused=False, kernel="flash"):
    """Bytes one block (full attention if `full`) holds over `media` without recomputation."""
    patches = sum(item.patches for item in media)
    c = vision.hidden
    dense = (ROPE_TENSORS * c * FP32 + (ATTENTION_TENSORS + 1) * c * elem + MLP_TENSORS * vision.intermediate * elem)
    lengths = attention_lengths(vision, media, full)
    return 2 * _norm(vision, patches, elem, fused) + patches * dense + kernel_bytes(vision, lengths, elem, kernel)


def outside_blocks(vision, media, elem, fused=False, own_pixels=False):
    """Bytes the tower holds outside its blocks: rotary tables, its own copy of the pixel rows, the merger."""
    patches = sum(item.patches for item in media)
    tables = patches * 2 * vision.head_dim * FP32
    pixels = patches * vision.patch_pixels * elem if own_pixels else 0
    merger = _norm(vision, patches, elem, fused) + patches * MERGER_TENSORS * vision.hidden * elem
    order = 2 * INDEX * patches // vision.merge_unit
    return tables + pixels + merger + order


def tower_bytes(vision, media, elem, fused=False, kernel="flash", recompute=False, own_pixels=False):
    """{"held": bytes the tower holds from its forward to its backward, "rebuilt": what recomputation rebuilds at
    once in backward (the largest block; 0 without)} over `media`; `own_pixels`: outside_blocks'."""
    if not media:
        return {"held": 0, "rebuilt": 0}
    patches = sum(item.patches for item in media)
    blocks = {full: block_bytes(vision, media, full, elem, fused, kernel) for full, count in block_kinds(vision)
              if count}
    if recompute:
        held = vision.depth * patches * vision.hidden * elem
        rebuilt = max(blocks.values())
    else:
        held = sum(count * blocks[full] for full, count in block_kinds(vision) if count)
        rebuilt = 0
    return {"held": held + outside_blocks(vision, media, elem, fused, own_pixels), "rebuilt": rebuilt}


def block_tiles(lengths):
    """(partial, full) 128 x 128 tiles of causal-free attention calls of `lengths` patches."""
    tiles = -(-lengths // TILE)
    full = (lengths // TILE) ** 2
    return int((tiles * tiles - full).sum()), int(full.sum())


def attention_seconds(vision, media):
    """Forward + backward of every block's attention over `media` on the GPU tile model, seconds."""
    if not media:
        return 0.0
    scale = vision.heads * vision.head_dim / (FIT_HEADS * FIT_HEAD_DIM)
    ms = 0.0
    for full, count in block_kinds(vision):
        if count:
            partial, whole = block_tiles(attention_lengths(vision, media, full))
            ms += count * ((PARTIAL_MS * partial + FULL_MS * whole) * scale + RANK_MS)
    return ms / 1e3


def attention_calls(vision, media):
    """Attention kernel calls of one forward of the tower as PaddleFormers makes them (one per window or frame)."""
    return sum(count * len(attention_lengths(vision, media, full)) for full, count in block_kinds(vision) if count)


def matmul_flops(vision, media):
    """Forward FLOPs of the tower's matmuls over `media` (the patch embedding, every block's, the merger's)."""
    return sum(item.patches for item in media) * vision.tower_matmul_flops
