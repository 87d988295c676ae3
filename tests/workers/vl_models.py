"""Tiny PaddleFormers vision-language models of each family, and real pictures and videos through their own
image and video processors (the inputs a user's data pipeline makes).

Stand-ins that make them run on CPU (test helpers, never the package): `qwen3_vl_moe` and `glm4v_moe` import GPU
fleet modules pip cannot install; `paddleocr_vl` imports triton kernels; Qwen2.5-VL's window index fails on
Paddle 3.3.1 CPU with a 0-D grid tensor (given the grid as host integers instead).
"""
from __future__ import annotations

import sys
import types

import numpy as np

import ernie_vl
from pictures import clip, picture
from paddleformers_models import stub_gpu_modules

TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, fuse_rms_norm=False)
# vision towers: 2 blocks, 4-pixel patches, 2 frames a temporal patch, 2x2 patches merged into one token
PATCH, TEMPORAL, MERGE = 4, 2, 2
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
              temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, out_hidden_size=64)
MROPE = [2, 3, 3]  # halves of the text head dim (16 / 2) given to t, h, w
# special token ids inside the 128-token vocabulary
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v_moe", "glm_ocr", "paddleocr_vl", "ernie4_5_vl")
# GLM-OCR's video path reads `self.visual.dtype`, which its vision model lacks (AttributeError on one card too);
# PaddleOCR-VL takes images only
VIDEO_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v_moe")


def stub_cpu_stand_ins():
    """The fleet and triton modules the VL families import, as modules with nothing GPU in them."""
    stub_gpu_modules()
    fleet = types.ModuleType("paddleformers.transformers.qwen3_vl.modeling_fleet")
    fleet.Qwen3VLModelDist = type("Qwen3VLModelDist", (), {})
    fleet.Qwen3VLProvider = type("Qwen3VLProvider", (), {})
    sys.modules.setdefault(fleet.__name__, fleet)
    triton = types.ModuleType("paddleformers.triton_kernels")

    def unavailable(*args, **kwargs):
        raise RuntimeError("triton is not installed")

    unavailable.is_available = lambda *args, **kwargs: False
    triton.apply_rotary_pos_emb_vision = unavailable
    sys.modules.setdefault(triton.__name__, triton)


def _window_index_from_host_grid(vision):
    """Qwen2.5-VL's get_window_index, given the grid as host integers (its 0-D grid tensors make Paddle 3.3.1's
    CPU pad kernel read a padding of -1)."""
    window_index = vision.get_window_index
    vision.get_window_index = lambda grid_thw: window_index(np.asarray(grid_thw.numpy(), dtype=np.int64))
    return vision


def _on_cpu(config):
    """The unfused RMSNorm everywhere: the fused kernel has no CPU build (vision configs drop the keyword)."""
    for part in (config, getattr(config, "text_config", None), getattr(config, "vision_config", None)):
        if part is not None:
            part.fuse_rms_norm = False
    return config


def build(family, **text):
    """A tiny model of `family` with its config's defaults (eager attention), the text part sized by TEXT."""
    if family == "ernie4_5_vl":  # its own helper: CPU stand-ins of its GPU ops, router losses off (ernie_vl.py)
        return ernie_vl.build(**ernie_vl.PARITY, **text)
    stub_cpu_stand_ins()
    text = {**TEXT, **text}
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO)
    if family == "qwen2_5_vl":  # windowed vision attention with one full block, [3, b, s] rope indices
        from paddleformers.transformers.qwen2_5_vl.configuration import Qwen2_5_VLConfig
        from paddleformers.transformers.qwen2_5_vl.modeling import Qwen2_5_VLForConditionalGeneration

        config = Qwen2_5_VLConfig(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": MROPE}},
            vision_config={**VISION, "window_size": 2 * PATCH * MERGE, "fullatt_block_indexes": [1]},
            vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, **tokens)
        model = Qwen2_5_VLForConditionalGeneration(_on_cpu(config))
        _window_index_from_host_grid(model.model.visual)
        return model
    if family in ("qwen3_vl", "qwen3_vl_moe"):  # deepstack features added after early decoder layers
        moe = family == "qwen3_vl_moe"
        if moe:
            from paddleformers.transformers.qwen3_vl_moe.configuration import Qwen3VLMoeConfig as Config
            from paddleformers.transformers.qwen3_vl_moe.modeling import (
                Qwen3VLMoeForConditionalGenerationDeprecated as Model)
            text = {**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "decoder_sparse_step": 1}
        else:
            from paddleformers.transformers.qwen3_vl.configuration import Qwen3VLConfig as Config
            from paddleformers.transformers.qwen3_vl.modeling import Qwen3VLForConditionalGenerationDeprecated as Model
        config = Config(
            text_config={**text, "head_dim": 16, "rope_scaling": {"rope_type": "default", "mrope_section": MROPE,
                                                                  "mrope_interleaved": True}},
            vision_config={**VISION, "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]},
            vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, **tokens)
        return Model(_on_cpu(config))
    if family == "glm4v_moe":  # MoE decoder (a dense first layer), partial RoPE
        from paddleformers.transformers.glm4v_moe.configuration import Glm4vMoeConfig
        from paddleformers.transformers.glm4v_moe.modeling import Glm4vMoeForConditionalGeneration

        config = Glm4vMoeConfig(
            text_config={**text, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                         "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2],  # half of 8 rotary dims
                                             "partial_rotary_factor": 0.5}},
            vision_config={**VISION, "image_size": 4 * PATCH * MERGE},
            image_start_token_id=VISION_START, image_end_token_id=VISION_END, video_start_token_id=124,
            video_end_token_id=125, **tokens)
        return Glm4vMoeForConditionalGeneration(_on_cpu(config))
    if family == "glm_ocr":
        from paddleformers.transformers.glm_ocr.configuration import GlmOcrConfig
        from paddleformers.transformers.glm_ocr.modeling import GlmOcrForConditionalGeneration

        config = GlmOcrConfig(
            text_config={**text, "mrope_section": MROPE},
            vision_config={**VISION, "image_size": 4 * PATCH * MERGE},
            image_start_token_id=VISION_START, image_end_token_id=VISION_END, video_start_token_id=124,
            video_end_token_id=125, **tokens)
        return GlmOcrForConditionalGeneration(_on_cpu(config))
    if family == "paddleocr_vl":  # an ERNIE 4.5 decoder, a SigLIP tower, image index assignment
        from paddleformers.transformers.paddleocr_vl.configuration import PaddleOCRVLConfig
        from paddleformers.transformers.paddleocr_vl.modeling import PaddleOCRVLForConditionalGeneration

        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "spatial_merge_size": MERGE,
                  "image_size": 4 * PATCH * MERGE}
        config = PaddleOCRVLConfig(**text, head_dim=16, vision_config=vision, vision_start_token_id=VISION_START,
                                   rope_scaling={"type": "mrope", "mrope_section": MROPE}, **tokens)
        return PaddleOCRVLForConditionalGeneration(_on_cpu(config))
    raise ValueError(f"unknown family {family!r}: use one of {FAMILIES}")


def _processors(family):
    """The family's own image and video processors at the tiny towers' patch sizes (None: takes no video)."""
    sizes = dict(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE)
    pixels = dict(min_pixels=16, max_pixels=64 * 64)
    edges = {"size": {"shortest_edge": 16, "longest_edge": 64 * 64}}
    if family in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        from paddleformers.transformers.qwen2_vl.image_processor_fast import Qwen2VLImageProcessorFast
        from paddleformers.transformers.qwen2_vl.video_processor import Qwen2VLVideoProcessor
        from paddleformers.transformers.qwen3_vl.video_processor import Qwen3VLVideoProcessor

        videos = Qwen2VLVideoProcessor(**sizes, **pixels) if family == "qwen2_5_vl" else Qwen3VLVideoProcessor(
            **sizes, **edges)
        return Qwen2VLImageProcessorFast(**sizes, **pixels), videos
    if family in ("glm4v_moe", "glm_ocr"):
        from paddleformers.transformers.glm4v_moe.image_processor_fast import Glm4vImageProcessorFast
        from paddleformers.transformers.glm4v_moe.video_processor import Glm4vVideoProcessor
        from paddleformers.transformers.glm_ocr.image_processor import Glm46VImageProcessor

        images = Glm4vImageProcessorFast(**sizes, **edges) if family == "glm4v_moe" else Glm46VImageProcessor(
            **sizes, **pixels)
        return images, Glm4vVideoProcessor(**sizes, **edges)
    if family == "paddleocr_vl":
        from paddleformers.transformers.paddleocr_vl.image_processor import PaddleOCRVLImageProcessor

        return PaddleOCRVLImageProcessor(**{**sizes, "temporal_patch_size": 1}, **pixels), None
    raise ValueError(f"unknown family {family!r}")


def _media_tokens(family, kind, grid):
    """The prompt tokens of one image or video of `grid` (t, h, w patches) as the family's processor lays
    them out: Qwen3-VL and GLM give each temporal patch of a video its own block after a timestamp."""
    t, h, w = (int(v) for v in grid)
    per_frame = h * w // (MERGE * MERGE)
    if family.startswith("glm"):
        if kind == "image":
            return [VISION_START] + [IMAGE] * t * per_frame + [VISION_END]
        frames = [[VISION_START] + [IMAGE] * per_frame + [VISION_END, 10 + f] for f in range(t)]
        return [124] + sum(frames, []) + [125]
    token = IMAGE if kind == "image" else VIDEO
    if kind == "video" and family in ("qwen3_vl", "qwen3_vl_moe"):
        return sum(([10 + f, VISION_START] + [token] * per_frame + [VISION_END] for f in range(t)), [])
    return [VISION_START] + [token] * t * per_frame + [VISION_END]


def conversation(family, rng, text=(5, 7), images=(), video=None, seed=0):
    """One sample: text, each image (width, height) and the video (frames, width, height) through the family's
    processors, text again. Labels: the text tokens' next-token targets, -100 on vision tokens and at the end."""
    import paddle

    image_processor, video_processor = _processors(family)
    inputs, ids = {}, list(rng.randint(1, 100, text[0]))
    if images:
        out = image_processor(images=[picture(w, h, seed + i) for i, (w, h) in enumerate(images)],
                              return_tensors="pd")
        inputs.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        for grid in out["image_grid_thw"].numpy():
            ids += _media_tokens(family, "image", grid) + list(rng.randint(1, 100, 2))
    if video is not None:
        out = video_processor(videos=[clip(*video, seed=seed + 7)], return_tensors="pd", do_sample_frames=False)
        inputs.update(pixel_values_videos=out["pixel_values_videos"], video_grid_thw=out["video_grid_thw"])
        ids += _media_tokens(family, "video", out["video_grid_thw"].numpy()[0])
    ids += list(rng.randint(1, 100, text[1]))
    ids = np.asarray(ids, np.int64)
    labels = np.where(ids < 100, np.roll(ids, -1), -100)
    labels[-1] = -100
    inputs.update(input_ids=paddle.to_tensor(ids[None]), labels=paddle.to_tensor(labels[None]))
    return inputs


def _joined(values, axis=0):
    import paddle

    values = [v for v in values if v is not None]
    return paddle.concat(values, axis=axis) if values else None


def packed(model, samples):
    """Samples end to end in one row, as PaddleFormers' mm_collate_fn packs them: each sample's rope indices
    from the model's own get_rope_index (restarting at 0), its documents as attn_mask_startend_row_indices."""
    import paddle

    rope = getattr(model, "get_rope_index", None) or model.model.get_rope_index
    positions, ends, start = [], [], 0
    for sample in samples:
        length = sample["input_ids"].shape[1]
        grids = {key: sample.get(key) for key in ("image_grid_thw", "video_grid_thw")}
        positions.append(rope(sample["input_ids"], **grids)[0])
        ends += [start + length] * length
        start += length
    batch = {key: _joined([sample.get(key) for sample in samples], axis=1 if key in ("input_ids", "labels") else 0)
             for key in ("input_ids", "labels", "pixel_values", "image_grid_thw", "pixel_values_videos",
                         "video_grid_thw")}
    batch = {key: value for key, value in batch.items() if value is not None}
    batch["position_ids"] = paddle.concat(positions, axis=2)  # [3, 1, s]
    batch["attn_mask_startend_row_indices"] = paddle.to_tensor(np.asarray(ends, np.int32)[None, None, :])
    return batch


def rows(samples):
    """Samples as rows of one batch, padded at the end to the longest (pad id 0, label -100) with a 2-D
    attention_mask marking the padding."""
    import paddle

    length = max(sample["input_ids"].shape[1] for sample in samples)

    def padded(value, fill):
        pad = length - value.shape[1]
        return paddle.concat([value, paddle.full([1, pad], fill, value.dtype)], axis=1) if pad else value

    batch = {key: paddle.concat([padded(sample[key], fill) for sample in samples])
             for key, fill in (("input_ids", 0), ("labels", -100))}
    batch["attention_mask"] = paddle.to_tensor(
        [[1] * sample["input_ids"].shape[1] + [0] * (length - sample["input_ids"].shape[1]) for sample in samples],
        dtype="int64")
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        value = _joined([sample.get(key) for sample in samples])
        if value is not None:
            batch[key] = value
    return batch


def batch_of(family, kind, model, world, seed=0):
    """A batch of `kind` (images: two of different sizes, video, packed: three samples in one row, rows: two
    padded rows, text) whose length 2 x `world` does not divide."""
    if family == "ernie4_5_vl":
        return ernie_vl.batch_of(kind, model, world, seed)
    rng = np.random.RandomState(seed)
    one_image = family == "paddleocr_vl"  # its rope index handles one image per sample

    def uneven(make):
        for extra in range(2 * world):
            batch = make(extra)
            if batch["input_ids"].shape[1] % (2 * world):
                return batch
        raise AssertionError("no uneven length")

    if kind == "images" and not one_image:
        return uneven(lambda extra: conversation(family, np.random.RandomState(seed), text=(5, 7 + extra),
                                                 images=((48, 24), (16, 16)), seed=seed))
    if kind in ("images", "rows"):
        return uneven(lambda extra: rows([conversation(family, np.random.RandomState(seed), text=(5, 7 + extra),
                                                       images=((48, 24),), seed=seed),
                                          conversation(family, np.random.RandomState(seed + 1), text=(3, 4),
                                                       images=((16, 16),), seed=seed + 1)]))
    if kind == "video":
        return uneven(lambda extra: conversation(family, rng, text=(4, 5 + extra), video=(4, 24, 16), seed=seed))
    if kind == "packed":
        return uneven(lambda extra: packed(model, [
            conversation(family, np.random.RandomState(seed), text=(3, 4), images=((16, 24),), seed=seed),
            conversation(family, np.random.RandomState(seed + 1), text=(6, 2 + extra)),
            conversation(family, np.random.RandomState(seed + 2), text=(2, 5), images=((16, 16),), seed=seed + 2)]))
    if kind == "text":
        return uneven(lambda extra: conversation(family, np.random.RandomState(seed), text=(9, 12 + extra)))
    raise ValueError(f"unknown batch kind {kind!r}")
