"""A vision tower's shape and parameter counts, and the media of a batch in its patches (pure, no Paddle).

Qwen2.5-VL's tower, as PaddleFormers 1.2.0 builds it (`Qwen2_5_VisionTransformerPretrainedModel`): a Conv3d patch
embedding (no bias) of `temporal_patch` frames x `patch` x `patch` pixels x `in_channels` into `hidden`; `depth`
blocks of RMSNorm, attention (one fused qkv with bias, an output projection with bias, 2-D rotary embeddings),
RMSNorm and a SwiGLU MLP with biases; blocks in `full_blocks` attend over each temporal patch of an image or video
(h x w patches), the others inside windows of `window` pixels a side; then the merger: an RMSNorm, each
`merge` x `merge` patches concatenated into one token, Linear(merge^2 hidden, merge^2 hidden) + GELU + Linear into
`out_hidden` (the language model's width).

Media as the processor gives them (Qwen2VL's image and video processors): sides resized to the nearest multiple of
patch x merge pixels (`smart_resize`, here without its min/max pixel bounds), a video's frames padded to a multiple
of `temporal_patch` (its last frame repeated), an image one temporal patch; grid (t, h, w) patches,
patches = t x h x w, tokens = patches / merge^2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# the families whose vision tower this file describes (config.json's model_type)
FAMILIES = ("qwen2_5_vl",)


@dataclass(frozen=True)
class VisionShape:
    depth: int
    hidden: int
    intermediate: int
    heads: int
    patch: int  # pixels a side of one patch
    temporal_patch: int  # frames in one patch
    merge: int  # patches a side merged into one token
    out_hidden: int  # the merged features' width (the language model's hidden size)
    window: int = 0  # pixels a side of a windowed block's attention window (0: every block attends whole frames)
    full_blocks: tuple = ()  # blocks attending over whole temporal patches
    in_channels: int = 3

    def __post_init__(self):
        object.__setattr__(self, "full_blocks", tuple(self.full_blocks))
        if self.hidden % self.heads:
            raise ValueError(f"vision hidden size {self.hidden} is not a multiple of its {self.heads} heads")
        if self.window and self.window % (self.patch * self.merge):
            raise ValueError(f"vision window_size {self.window} is not a multiple of patch x merge "
                             f"({self.patch} x {self.merge}) pixels")

    @classmethod
    def from_config(cls, vision_config, family):
        """From a config.json's `vision_config` dict (Qwen2.5-VL's fields: Hugging Face's and PaddleFormers')."""
        if family not in FAMILIES:
            raise ValueError(f"{family}'s vision tower is not modelled: pcp-plan models Qwen2.5-VL's "
                             f"({', '.join(FAMILIES)}: windowed attention, SwiGLU MLP, one merger)")
        c = vision_config
        return cls(depth=c["depth"], hidden=c["hidden_size"], intermediate=c["intermediate_size"], heads=c["num_heads"],
                   patch=c["patch_size"], temporal_patch=c.get("temporal_patch_size", 2),
                   merge=c.get("spatial_merge_size", 2), out_hidden=c["out_hidden_size"],
                   window=c.get("window_size") or 0, full_blocks=tuple(c.get("fullatt_block_indexes") or ()),
                   in_channels=c.get("in_channels") or c.get("in_chans") or 3)

    @property
    def head_dim(self):
        return self.hidden // self.heads

    @property
    def merge_unit(self):
        """Patches merged into one token."""
        return self.merge * self.merge

    @property
    def patch_pixels(self):
        """Values of one patch row of pixel_values: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch * self.patch * self.patch

    @property
    def window_side(self):
        """Patches a side of an attention window (0: no windowed blocks)."""
        return self.window // self.patch

    @property
    def windowed_blocks(self):
        return self.depth - len(self.full_blocks) if self.window else 0

    # ---- parameters, by where they live ---------------------------------------------

    @property
    def block_params(self):
        """One block's: qkv and proj with biases, gate/up/down with biases, two norms."""
        c, i = self.hidden, self.intermediate
        return 4 * c * c + 4 * c + 3 * c * i + 2 * i + c + 2 * c

    @property
    def merger_params(self):
        wide = self.merge_unit * self.hidden
        return self.hidden + wide * wide + wide + wide * self.out_hidden + self.out_hidden

    @property
    def params(self):
        return self.patch_pixels * self.hidden + self.depth * self.block_params + self.merger_params

    @property
    def largest_param(self):
        wide = self.merge_unit * self.hidden
        return max(wide * wide, wide * self.out_hidden, self.hidden * self.intermediate)

    # ---- FLOPs, forward of one patch ----------------------------------------------------

    @property
    def block_matmul_flops(self):
        """A block's projections and MLP, forward, per patch (attention's products are priced by tiles)."""
        return 2 * (4 * self.hidden * self.hidden + 3 * self.hidden * self.intermediate)

    @property
    def tower_matmul_flops(self):
        """The patch embedding, every block's matmuls and the merger, forward, per patch."""
        wide = self.merge_unit * self.hidden
        merger = 2 * (wide * wide + wide * self.out_hidden) / self.merge_unit
        return 2 * self.patch_pixels * self.hidden + self.depth * self.block_matmul_flops + merger


@dataclass(frozen=True)
class Media:
    """One image or video as the vision tower takes it: its grid of t x h x w patches."""

    kind: str  # "image" or "video"
    t: int
    h: int
    w: int

    @property
    def patches(self):
        return self.t * self.h * self.w

    @property
    def frame_patches(self):
        """Patches of one temporal patch (what a full-attention block attends over)."""
        return self.h * self.w

    def tokens(self, vision):
        return self.patches // vision.merge_unit

    def frames(self, t0, t1):
        """Temporal patches [t0, t1) of this item, as an item of their own."""
        return Media(self.kind, t1 - t0, self.h, self.w)


def _side(vision, pixels):
    """Patches along a side of `pixels`, resized to the nearest multiple of patch x merge (at least one)."""
    factor = vision.patch * vision.merge
    return max(1, round(pixels / factor)) * vision.merge


def image(vision, height, width):
    return Media("image", 1, _side(vision, height), _side(vision, width))


def video(vision, frames, height, width):
    if frames < 1:
        raise ValueError(f"a video needs at least one frame, not {frames}")
    return Media("video", math.ceil(frames / vision.temporal_patch), _side(vision, height), _side(vision, width))


def media_tokens(vision, media):
    """Tokens the media take in the language model's sequence: their features and a vision start and end each."""
    return sum(item.tokens(vision) + 2 for item in media)
