"""The vision-language stage's pieces on one process: rope layouts, the rows of image tokens a rank keeps, the
media checks, which rule claims which layer."""
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

import paddle_cp as pcp
from paddle_cp.attention import SequenceLayout
from paddle_cp.plans import vision_language as vl

RULE = pcp.VisionLanguage("tests.unit", merges={"Top": "inner.language"}, language_models=("Language",))


def test_rope_indices_split_on_their_sequence_dim_and_a_wrong_layout_names_the_right_one():
    assert vl.position_split_dim(RULE, paddle.zeros([3, 2, 9], "int64"), 2, 9) == 2
    assert vl.position_split_dim(RULE, paddle.zeros([4, 2, 9], "int64"), 2, 9) == 2  # text row first
    assert vl.position_split_dim(RULE, paddle.zeros([2, 9], "int64"), 2, 9) == 1
    ernie = pcp.VisionLanguage("x", merges={}, language_models=(), positions="bs3")
    assert vl.position_split_dim(ernie, paddle.zeros([2, 9, 3], "int64"), 2, 9) == 1
    with pytest.raises(ValueError, match=r"\[3, batch, seq\].*2 x 9 tokens"):
        vl.position_split_dim(RULE, paddle.zeros([2, 3, 9], "int64"), 2, 9)
    with pytest.raises(ValueError, match=r"\[batch, seq, 3\]"):
        vl.position_split_dim(ernie, paddle.zeros([3, 2, 9], "int64"), 2, 9)
    with pytest.raises(ValueError, match="positions='xyz'"):
        pcp.VisionLanguage("x", merges={}, language_models=(), positions="xyz")


def test_text_positions_are_the_row_documents_restart():
    positions = paddle.to_tensor(np.arange(3 * 2 * 5).reshape(3, 2, 5))
    assert (vl.text_positions(positions).numpy() == positions.numpy()[0]).all()
    ernie = paddle.to_tensor(np.arange(2 * 5 * 3).reshape(2, 5, 3))
    assert (vl.text_positions(ernie).numpy() == ernie.numpy()[:, :, 0]).all()
    plain = paddle.arange(5).reshape([1, 5])
    assert vl.text_positions(plain) is plain


@pytest.mark.parametrize("backend,world,degree", [("p2p", 2, None), ("p2p", 3, None), ("hybrid", 4, 2)])
def test_each_rank_keeps_the_rows_of_its_image_tokens_in_local_order(backend, world, degree):
    rng = np.random.RandomState(0)
    mask = rng.rand(2, 23) < 0.4  # [b, s]: image tokens
    rows = paddle.to_tensor(np.arange(int(mask.sum()) * 2, dtype="float32").reshape(-1, 2))  # one per True, row-major
    layout = SequenceLayout(backend, world, degree)
    flat_rows = rows.numpy()
    owner = -np.ones(mask.shape, np.int64)
    owner[mask] = np.arange(int(mask.sum()))  # which row each image token's is
    for index in range(world):
        mine = layout.positions(23, index)
        want = np.concatenate([flat_rows[owner[b, mine][mask[b, mine]]] for b in range(2)])
        got = vl.local_rows([rows, rows * 2], paddle.to_tensor(mask), layout, index)
        assert np.array_equal(got[0].numpy(), want) and np.array_equal(got[1].numpy(), 2 * want)


class _Model:
    config = SimpleNamespace(image_token_id=7, video_token_id=8, vision_config=SimpleNamespace(spatial_merge_size=2))


def _inputs(image_tokens=6, video_tokens=4, patches=None):
    ids = np.array([[1] * 3 + [7] * image_tokens + [2] + [8] * video_tokens + [3]])
    grids = np.array([[1, 4, 4], [1, 2, 4]])  # 16 + 8 patches -> 4 + 2 image features
    return {"input_ids": paddle.to_tensor(ids), "pixel_values": paddle.zeros([patches or 24, 12]),
            "image_grid_thw": paddle.to_tensor(grids), "pixel_values_videos": paddle.zeros([16, 12]),
            "video_grid_thw": paddle.to_tensor([[2, 2, 4]])}  # 16 patches -> 4 video features


def test_media_checks_count_patches_and_placeholders_per_token():
    assert vl.media_refusal(RULE, _Model(), _inputs()) is None
    assert "makes 24 patches" in str(vl.media_refusal(RULE, _Model(), _inputs(patches=20)))
    assert "hold 5 placeholder tokens (id 7)" in str(vl.media_refusal(RULE, _Model(), _inputs(image_tokens=5)))
    assert "hold 3 placeholder tokens (id 8)" in str(vl.media_refusal(RULE, _Model(), _inputs(video_tokens=3)))
    shared = pcp.VisionLanguage("x", merges={}, language_models=(), media=(
        pcp.IMAGES, pcp.Media("video", "pixel_values_videos", "video_grid_thw", "image_token_id")))
    refusal = vl.media_refusal(shared, _Model(), _inputs())  # videos on the image placeholder: 6 + 4 expected
    assert "hold 6 placeholder tokens (id 7) but the image and video grids make 10" in str(refusal)
    no_grid = {k: v for k, v in _inputs().items() if k != "video_grid_thw"}
    assert "pixel_values_videos given without video_grid_thw" in str(vl.media_refusal(RULE, _Model(), no_grid))


def test_rules_claim_their_classes_and_an_unknown_vision_language_model_is_refused():
    class Top(paddle.nn.Layer):
        def forward(self, input_ids, pixel_values=None):
            return input_ids

    class Language(paddle.nn.Layer):
        def forward(self, inputs_embeds):
            return inputs_embeds

    Top.__module__ = Language.__module__ = "tests.unit.family"
    pcp.register_vision_language(RULE)
    assert vl.merging_rule(Top()) is RULE and vl.language_model_rule(Language()) is RULE
    assert vl.merging_rule(Language()) is None
    vl.check_known(Top())  # a rule knows it

    class Other(Top):
        pass

    with pytest.raises(ValueError, match=r"Other takes \['pixel_values'\].*register_vision_language"):
        vl.check_known(Other())
    with pytest.raises(TypeError, match="takes a VisionLanguage"):
        pcp.register_vision_language({"merges": {}})


@pytest.mark.parametrize("backend,world,degree", [("p2p", 2, None), ("p2p", 3, None), ("all2all", 2, None),
                                                  ("hybrid", 4, 2)])
def test_a_shifted_input_keeps_its_tokens_values_then_each_rows_largest(backend, world, degree):
    types = np.zeros((2, 24), np.int64)  # [b, s + 1]: each of 23 tokens' type, then the last label's
    types[0, 9:12] = 1  # row 0: an image's tokens, mid-sequence
    types[1, 10] = 2  # row 1: one video token
    layout = SequenceLayout(backend, world, degree)
    text_only = []
    for index in range(world):
        got = vl.local_shifted(paddle.to_tensor(types), layout, index).numpy()
        mine = layout.positions(23, index)
        assert np.array_equal(got[:, :-1], types[:, mine])  # [..., :-1]: its tokens' own values, in local order
        assert np.array_equal(got[:, -1], types.max(axis=1))
        assert got.any() and (got == 2).any()  # what the whole tensor says, every rank says
        text_only.append(not types[:, mine].any())
    assert any(text_only), "some rank must hold text tokens only, or the last column is not tested"


def test_documents_a_top_model_drops_are_refused_and_others_pass():
    dropping = pcp.VisionLanguage("x", merges={}, language_models=(), documents=False)
    rows = paddle.zeros([1, 1, 9], "int32")
    refusal = vl.documents_refusal(dropping, _Model(), {"attn_mask_startend_row_indices": rows})
    assert "_Model takes attn_mask_startend_row_indices" in str(refusal) and "dense attention_mask" in str(refusal)
    assert vl.documents_refusal(dropping, _Model(), {"input_ids": rows}) is None
    assert vl.documents_refusal(RULE, _Model(), {"attn_mask_startend_row_indices": rows}) is None


class _Ernie:
    config = SimpleNamespace(im_patch_id=9, spatial_conv_size=2, temporal_conv_size=2)


def test_frames_merged_into_one_token_count_rounded_up():
    media = pcp.Media("image or video", "images", "grid_thw", "im_patch_id", frames="temporal_conv_size")
    rule = pcp.VisionLanguage("x", merges={}, language_models=(), media=(media,), merge="spatial_conv_size")
    grids = [[1, 4, 4], [4, 4, 4], [3, 2, 2]]  # 4 tokens (an image), 2 x 4 (4 frames), 2 x 1 (3 frames: rounded up)
    inputs = {"images": paddle.zeros([16 + 64 + 12, 48]), "grid_thw": paddle.to_tensor(grids)}
    assert vl.media_refusal(rule, _Ernie(), {**inputs, "input_ids": paddle.to_tensor([[9] * 14 + [1]])}) is None
    refusal = vl.media_refusal(rule, _Ernie(), {**inputs, "input_ids": paddle.to_tensor([[9] * 13 + [1]])})
    assert "hold 13 placeholder tokens (id 9) but the image or video grids make 14 features (ceil(t / 2) x h x w / 4" \
        in str(refusal)


def test_a_config_the_rule_refuses_is_refused_naming_the_value_that_trains():
    class Refusing(paddle.nn.Layer):
        def __init__(self, heads):
            super().__init__()
            self.config = SimpleNamespace(second_head=heads)

        def forward(self, input_ids, images=None):
            return input_ids

    Refusing.__module__ = "tests.unit.refusing"
    pcp.register_vision_language(pcp.VisionLanguage("tests.unit.refusing", merges={"Refusing": "inner"},
                                                    language_models=(), refused={"second_head": (0, "two means")}))
    vl.check_config(Refusing(0))
    with pytest.raises(ValueError, match=r"Refusing has second_head=8: two means\. Train it with second_head=0"):
        vl.check_config(Refusing(8))
