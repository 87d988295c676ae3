"""The vision split's layout on one process: which rank holds each position, the pieces placed around a language
layout (both stages priced), a piece's attention documents, the pieces a batch's media make."""
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

import paddle_cp as pcp
from paddle_cp.attention import SequenceLayout
from paddle_cp.cost.vision_layout import document_tile_ms, place, rank_of_positions
from paddle_cp.plans import vision_split


@pytest.mark.parametrize("backend,world,degree", [("p2p", 4, None), ("all2all", 3, None), ("hybrid", 4, 2)])
def test_the_rank_of_each_position_is_the_layouts(backend, world, degree):
    layout = SequenceLayout(backend, world, degree)
    owner = rank_of_positions(vision_split.layout_groups(layout, 37), layout.ulysses)
    for rank in range(world):
        assert np.array_equal(np.flatnonzero(owner == rank), np.sort(layout.positions(37, rank)))


def test_pieces_are_balanced_stage_by_stage_and_go_where_their_tokens_are_when_that_is_free():
    language = np.array([10.0, 0.0, 0.0, 0.0])  # the exchange waits for every rank: stages are balanced apart
    owners = np.array([[4, 0, 0, 0], [0, 0, 0, 4], [0, 4, 0, 0], [0, 0, 4, 0], [4, 0, 0, 0]])  # [piece, rank]
    placed = place(np.ones(5) * 3.0, owners, language, np.zeros((4, 4)))
    assert placed.rank.tolist() == [0, 3, 1, 2, 0] and placed.vision_ms.tolist() == [6.0, 3.0, 3.0, 3.0]
    assert placed.rows_moved == 0 and placed.slowest_ms == 6.0 + 10.0
    # every token on rank 0, a row 0.2 ms to receive: three pieces leave (their 12 rows cost rank 0 2.4 ms), the
    # fifth stays (another 0.8 ms would cost more than its 3 ms on rank 0)
    costly = place(np.ones(5) * 3.0, owners[[0, 0, 0, 0, 0]], np.zeros(4), np.full((4, 4), 0.2))
    assert costly.rank.tolist() == [0, 1, 2, 3, 0] and costly.received.tolist() == [12, 0, 0, 0]
    assert np.isclose(costly.slowest_ms, 6.0 + 2.4)


def test_placement_balances_many_pieces_of_different_costs():
    rng = np.random.RandomState(0)
    cost = rng.lognormal(0, 1, 200)
    placed = place(cost, np.zeros((200, 8), np.int64), np.zeros(8), np.zeros((8, 8)))
    assert placed.vision_ms.max() / placed.vision_ms.mean() < 1.01


def test_a_piece_attends_in_its_windows_but_in_the_full_blocks():
    spec = pcp.VisionTower(("X",), windowed=True)
    config = SimpleNamespace(spatial_merge_size=2, window_size=112, patch_size=14, fullatt_block_indexes=[1])
    blocks = spec.documents(config, 3, 20, 12)  # windows of 8 x 8 patches: 3 rows x 2 columns of windows
    assert blocks[1] == [240] and sorted(blocks[0]) == sorted([64, 32, 64, 32, 32, 16]) and blocks[2] == blocks[0]
    assert pcp.VisionTower(("X",)).documents(config, 2, 20, 12) == [[240], [240]]
    assert document_tile_ms([128]) == pytest.approx(0.00236) and document_tile_ms([129]) == pytest.approx(
        0.00236 + 3 * 0.00354)  # one full tile; then three partial ones at its edge


def test_a_batchs_media_make_one_piece_a_temporal_patch():
    rule = pcp.VisionLanguage("x", merges={}, language_models=())
    model = SimpleNamespace(config=SimpleNamespace(image_token_id=7, video_token_id=8,
                                                   vision_config=SimpleNamespace(spatial_merge_size=2)))
    ids = [[1, 7, 7, 7, 7, 2, 8, 8, 8, 8, 8, 8, 8, 8, 3]]  # an image of 4 tokens, a video of 2 x 4
    given = {"input_ids": paddle.to_tensor(ids), "pixel_values": paddle.zeros([16, 3]),
             "image_grid_thw": paddle.to_tensor([[1, 4, 4]]), "pixel_values_videos": paddle.zeros([32, 3]),
             "video_grid_thw": paddle.to_tensor([[2, 4, 4]])}
    pieces = vision_split.media_pieces(rule, model, given)
    video = pieces["video"]
    assert video.grids.tolist() == [[1, 4, 4], [1, 4, 4]] and video.rows.tolist() == [0, 16, 32]
    assert video.features.tolist() == [0, 4, 8] and video.positions.tolist() == list(range(6, 14))
    assert pieces["image"].positions.tolist() == [1, 2, 3, 4]

