"""pcp-bench --vision's figures (the GPU cost model, no launch): Qwen2.5-VL-7B's image, video and page mixes over
8 ranks with the vision tower split as paddle_cp splits it, against the tower whole and the others' splits."""
import pytest

from paddle_cp.tools.bench import vision



@pytest.fixture(scope="module")
def rows():
    return {(row["mix"], row["layout"]): row for row in vision.rows_of(vision.parse_args(["--sep", "8"]))}


@pytest.mark.parametrize("mix", vision.MIXES)
def test_the_split_balances_both_stages_and_moves_only_the_features_tokens_need(rows, mix):
    split = rows[mix, "paddle_cp"]
    assert split["vision_max_over_mean"] <= 1.10 and split["total_max_over_mean"] <= 1.10, split
    assert split["received_rows_max"] == split["least_rows_max"]  # each feature only to its token's rank
    assert split["held_max"] < split["features"] / 2  # no rank holds every image's features (here: a quarter)
    whole = rows[mix, "whole"]
    assert whole["held_max"] == whole["features"] and split["slowest_ms"] < 0.6 * whole["slowest_ms"]
    for other in ("by-count", "by-cost"):  # all-gathered features: every rank receives all it did not compute
        assert rows[mix, other]["received_rows_max"] > 4 * split["received_rows_max"], (mix, other)
        assert rows[mix, other]["slowest_ms"] >= split["slowest_ms"] * 0.999, (mix, other)


def test_a_long_video_by_count_sits_on_one_rank(rows):
    assert rows["video", "by-count"]["vision_max_over_mean"] == 8.0  # one medium, one rank
