"""The vision tower's cost terms against their arithmetic: Qwen2.5-VL-7B's shape and parameters, media as patch
grids, attention windows and tiles, the held-activation inventory against its allocator measurement, the split's
pieces and features, and what a vision-language batch adds to a layout's memory and step time."""
import dataclasses

import numpy as np
import pytest

from paddle_cp.cost.candidate import Cluster, Layout
from paddle_cp.cost.memory import memory
from paddle_cp.cost.model_shape import ModelShape
from paddle_cp.cost.step_time import step_time
from paddle_cp.cost.tiles import RANK_MS
from paddle_cp.cost.vision_language import VisionBatch
from paddle_cp.cost.vision_shape import VisionShape, image, media_tokens, video
from paddle_cp.cost.vision_split import feature_positions, split_layout
from paddle_cp.cost.vision_tower import (attention_calls, attention_lengths, block_tiles, matmul_flops, tower_bytes,
                                         window_lengths)
from paddle_cp.tools.plan.models import NAMED

QWEN25_VL_7B = ModelShape.from_config(NAMED["qwen2.5-vl-7b"])
VISION = QWEN25_VL_7B.vision
# pcp-memory's tiny tower (tests/workers/vl_models.py's): 4-pixel patches, windows of 2 x 2 merged tokens
TINY = VisionShape(depth=2, hidden=32, intermediate=64, heads=2, patch=4, temporal_patch=2, merge=2, out_hidden=64,
                   window=16, full_blocks=(1,))
CLUSTER = Cluster(8, 80e9, 700e12, 300e9, 25e9, 8, 300e12)


def test_qwen25_vl_7b_has_its_published_shape_and_parameters():
    c, i = 1280, 3420
    block = (3 * c * c + 3 * c) + (c * c + c) + (2 * (c * i + i) + i * c + c) + 2 * c  # qkv, proj, SwiGLU, norms
    merger = c + (4 * c) ** 2 + 4 * c + 4 * c * 3584 + 3584
    assert VISION.params == 3 * 2 * 14 * 14 * c + 32 * block + merger == 676_550_144
    assert (QWEN25_VL_7B.layers, QWEN25_VL_7B.hidden, QWEN25_VL_7B.kv_heads, QWEN25_VL_7B.family) == (
        28, 3584, 4, "qwen2_5_vl")
    assert 8.2e9 < QWEN25_VL_7B.params < 8.3e9  # 8.29B: Qwen's model card
    # PaddleFormers' own layout (text fields under text_config) reads the same
    config = NAMED["qwen2.5-vl-7b"]
    text = {k: v for k, v in config.items() if k not in ("model_type", "vision_config")}
    nested = {"model_type": "qwen2_5_vl", "text_config": {**text, "model_type": "qwen2_5_vl_text"},
              "vision_config": config["vision_config"]}
    assert ModelShape.from_config(nested) == QWEN25_VL_7B


def test_paddleformers_defaults_differ_from_the_published_7b_where_the_docs_say():
    configuration = pytest.importorskip("paddleformers.transformers.qwen2_5_vl.configuration")
    vision, text = configuration.Qwen2_5_VLVisionConfig(), configuration.Qwen2_5_VLTextConfig()
    published = NAMED["qwen2.5-vl-7b"]["vision_config"]
    differ = {key for key in published if key != "in_chans" and getattr(vision, key) != published[key]}
    assert differ == {"hidden_size", "tokens_per_second"}  # 3584 and 4 in PaddleFormers, 1280 and 2 published
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (8192, 80, 152064)  # 72B-sized text


def test_a_towers_other_than_qwen25_vl_are_refused_by_name():
    with pytest.raises(ValueError, match="qwen3_vl's vision tower is not modelled.*qwen2_5_vl"):
        VisionShape.from_config(NAMED["qwen2.5-vl-7b"]["vision_config"], "qwen3_vl")


def test_a_video_is_patches_of_temporal_pairs_and_tokens_of_merged_windows():
    minute = video(VISION, 120, 448, 448)  # 1 minute at 2 fps
    assert (minute.t, minute.h, minute.w, minute.patches, minute.tokens(VISION)) == (60, 32, 32, 61440, 15360)
    ten = video(VISION, 1200, 448, 448)
    assert (ten.patches, ten.tokens(VISION)) == (614400, 153600)
    assert video(VISION, 121, 448, 448).t == 61  # an odd frame count padded to a temporal pair
    # sides resized to the nearest multiple of patch x merge (28 pixels): 500 -> 504 (18 tokens' worth), 300 -> 308
    assert (image(VISION, 500, 300).h, image(VISION, 500, 300).w, image(VISION, 500, 300).t) == (36, 22, 1)
    assert media_tokens(VISION, [minute, image(VISION, 448, 448)]) == 15360 + 256 + 4  # a start and end token each


def test_windows_tile_each_frame_as_get_window_index_cuts_it():
    frame = video(VISION, 2, 448, 448)  # 32 x 32 patches: 16 windows of 8 x 8
    assert window_lengths(VISION, frame).tolist() == [64] * 16
    edge = image(VISION, 500, 300)  # 36 x 22 patches: windows of 8 x 8, 4 x 8, 8 x 6, 4 x 6 at the edges
    lengths = window_lengths(VISION, edge)
    assert lengths.sum() == edge.patches and len(lengths) == 5 * 3 and sorted(set(lengths.tolist())) == [24, 32, 48, 64]
    assert attention_lengths(VISION, [frame, edge], True).tolist() == [1024, 792]  # full blocks: each temporal patch
    assert attention_calls(VISION, [frame]) == 28 * 16 + 4 * 1  # PaddleFormers' one call per window or frame


def test_attention_calls_price_their_own_tiles():
    assert block_tiles(np.array([64])) == (1, 0)  # a window inside one tile: partial
    assert block_tiles(np.array([1024])) == (0, 64)  # a 448 x 448 frame: 8 x 8 full tiles
    assert block_tiles(np.array([200, 64])) == (3 + 1, 1)


def test_held_activations_reproduce_the_allocator_measurement():
    """pcp-memory's tiny tower, fp32, eager attention, a video of 8 frames at 64 x 64 (4 x 16 x 16 patches): Paddle's
    allocator measured 9,134,080 bytes held from the tower's forward to its backward, its 256 x 64 features
    included (PaddleFormers 1.2.0, Paddle 3.3.1 CPU); full recomputation keeps each block's input alone."""
    clip = [video(TINY, 8, 64, 64)]
    assert tower_bytes(TINY, tuple(clip), 4, kernel="eager")["held"] == 9_134_080 - 256 * 64 * 4
    eager, flash = (tower_bytes(TINY, tuple(clip), 4, kernel=k)["held"] for k in ("eager", "flash"))
    probabilities = 2 * 4 * (16 * 64 * 16 + 4 * 256 * 256)  # heads x fp32 x sum of L^2: windowed block, full block
    assert eager - flash == probabilities - 2 * 1024 * 2 * 4  # flash: an fp32 lse per head and patch instead
    recomputed = tower_bytes(TINY, tuple(clip), 4, kernel="eager", recompute=True)
    outside = tower_bytes(dataclasses.replace(TINY, depth=0, full_blocks=()), tuple(clip), 4)["held"]
    assert recomputed["held"] == 2 * 1024 * 32 * 4 + outside
    assert recomputed["rebuilt"] == tower_bytes(dataclasses.replace(TINY, depth=1, full_blocks=(0,)), tuple(clip), 4,
                                                kernel="eager")["held"] - outside


def test_below_fp32_the_norms_and_rope_keep_fp32_copies():
    clip = (video(VISION, 4, 448, 448),)
    bf16, fp32 = (tower_bytes(VISION, clip, elem)["held"] for elem in (2, 4))
    assert 0.5 * fp32 < bf16 < 0.75 * fp32  # not half: fp32 norm inputs, rotary tables and RoPE's q and k
    copied = tower_bytes(VISION, clip, 2, own_pixels=True)["held"] - bf16  # its pixel rows: a cast, or the split's
    assert copied == clip[0].patches * 3 * 2 * 14 * 14 * 2


def test_split_pieces_are_whole_temporal_patches_and_every_feature_is_computed_once():
    media = (image(VISION, 448, 448), video(VISION, 40, 448, 448))  # an image and 20 temporal patches
    seq = media_tokens(VISION, media) + 100
    split = split_layout(QWEN25_VL_7B, media, seq, 4, 1, 2)
    pieces = [piece for share in split.shares for piece in share]
    assert sorted(p.patches for p in pieces) == [1024] * 21 and all(p.t == 1 for p in pieces)
    assert all(p.h % VISION.merge == 0 and p.w % VISION.merge == 0 for p in pieces)  # merge windows whole
    assert max(sum(p.patches for p in share) for share in split.shares) <= 7 * 1024  # within one piece of 21 / 4
    assert sum(split.received) == sum(split.sent) > 0
    positions = feature_positions(VISION, media)
    assert positions[0] == 1 and positions[256] == 256 + 3 and len(positions) == 21 * 256  # past start/end tokens


def test_whole_mode_holds_n_times_the_split_on_equal_shares():
    media = (video(VISION, 16, 448, 448),)  # 8 temporal patches over 4 ranks: two each
    seq = media_tokens(VISION, media)
    split = split_layout(QWEN25_VL_7B, media, seq, 4, 1, 2)
    assert [sum(p.patches for p in share) for share in split.shares] == [2048] * 4
    whole = tower_bytes(VISION, media, 2)["held"]
    assert whole == 4 * tower_bytes(VISION, split.busiest(), 2)["held"]


def test_a_vision_language_batch_adds_its_terms_to_the_first_stage():
    minute = (video(VISION, 120, 448, 448),)
    seq = media_tokens(VISION, minute)
    text_model = dataclasses.replace(QWEN25_VL_7B, vision=None)
    layout = Layout(ring=8, recompute="full")
    text = memory(text_model, layout, seq)
    whole, split = (memory(QWEN25_VL_7B, layout, seq, vision=VisionBatch(minute, mode)) for mode in ("whole", "split"))
    assert whole["weights"] - text["weights"] == VISION.params * 2  # the tower's bf16 weights, on every rank
    assert whole["activations"] == text["activations"]  # the decoder's own are the same
    assert whole["vision_activations"] > 6 * split["vision_activations"]  # 60 pieces over 8 ranks
    assert whole["merge"] == split["merge"] == seq * 3584 * 9  # masked_scatter's int64 index and bool mask
    assert whole["pixel_values"] == 61440 * 1176 * 4  # the batch's fp32 patches on every rank
    # the batch check fingerprints them at the forward's start: an int64 copy and 9 chunks of 2^20 int64 temporaries
    base = whole["weights"] + whole["optimizer"]
    assert whole["phases"]["batch_check"] == base + whole["pixel_values"] + 8 * 10 * 2 ** 20  # a chunk at a time
    assert whole["peak"] - split["peak"] > 0.8 * (whole["vision_activations"] - split["vision_activations"])
    assert whole["exchange_bytes"] == 0 < split["exchange_bytes"]
    # a text batch on the VL model: the tower's bf16 weights, fp32 master and moments, fp32 gradients
    assert memory(QWEN25_VL_7B, layout, seq)["peak"] == text["peak"] + VISION.params * (2 + 12 + 4)


def test_the_tower_runs_on_the_busiest_rank_in_the_step_time():
    minute = (video(VISION, 120, 448, 448),)
    seq = media_tokens(VISION, minute)
    layout = Layout(ring=8)
    whole, split = (step_time(QWEN25_VL_7B, layout, CLUSTER, seq, 1, 2, vision=VisionBatch(minute, mode))
                    for mode in ("whole", "split"))
    assert whole["vision_compute"] > 3 * matmul_flops(VISION, minute) / CLUSTER.flops  # and its attention
    share = split_layout(QWEN25_VL_7B, minute, seq, 8, 1, 2).busiest()
    fixed = VISION.depth * RANK_MS / 1e3  # the tile model's fixed cost, once per block on every rank
    assert split["vision_compute"] - fixed == pytest.approx(
        (whole["vision_compute"] - fixed) * sum(p.patches for p in share) / 61440)
    assert whole["feature_exchange"] == 0 < split["feature_exchange"]
    assert whole["compute"] == split["compute"]  # the decoder's is the same
