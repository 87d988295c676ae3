"""One pool over dp x sep (PrepareContextParallel(pool=True)) on dp2 x sep4: trains like one card on the global
batch, moves exactly the planned exchange's bytes, and refuses a rank passing another batch on every rank
(tests/workers/pool_parity.py, one launch of 8 ranks). The criteria, tiles and bytes on held-out document mixes,
are computed without ranks in tests/unit/test_pool_layout.py."""
import pytest
from launcher import launch_once

from test_context_parallel import assert_close


@pytest.fixture(scope="module")
def reports():
    pytest.importorskip("paddleformers")
    return launch_once("pool_parity.py", 8)


def test_pool_trains_like_one_card_on_the_global_batch(reports):
    """Loss, first-step gradients and parameters after 3 AdamW steps within 1e-5 of one card; the labels
    shard_sequence split unshard to the global batch's; rows without documents, left-padded, give one card's
    loss (0.059 off with the padding keys left visible)."""
    assert_close(reports)
    for report in reports:
        for case in ("short", "long", "whole"):
            assert {f"{case}.{kind}" for kind in ("loss", "grad", "param", "unshard")} <= set(report["max_abs"])
        assert "padded.loss" in report["max_abs"]


def test_ranks_hold_the_global_batch_by_documents(reports):
    """Every token of the global batch on exactly one rank, counts uneven (documents kept whole, not 2N chunks)."""
    for case, (rows, seq) in {"short": (4, 509), "long": (2, 1021), "whole": (4, 509)}.items():
        tokens = [r["values"][f"{case}.tokens"] for r in reports]
        assert sum(tokens) == rows * seq and len(set(tokens)) > 1, (case, tokens)


def test_a_step_chooses_its_layout_once(reports):
    """shard_sequence lays the labels out before the forward; the forward takes that layout (the chooser runs
    once in the step, not twice)."""
    for report in reports:
        for case in ("short", "long", "whole"):
            assert report["values"][f"{case}.layouts_chosen"] == 1, report["values"][f"{case}.layouts_chosen"]


def test_ring_moves_what_the_plan_reads(reports):
    """Documents longer than a rank's share (254 tokens on 8 ranks: `short` and `long` have some), cut over ranks:
    the ring moves exactly the planned exchange's bytes (the k/v rows other ranks' tiles read, forward and
    backward, and their gradients), and with one dtype that is 3 x the rows read. SFT-like documents (`whole`, 61
    tokens at most) are each whole on a rank: no byte moves, whole blocks would have sent 7 of 8 ranks' k/v."""
    for case in ("short", "long", "whole"):
        for report in reports:
            values = report["values"]
            assert values[f"{case}.ring_bytes"] == values[f"{case}.ring_bytes_planned"], (case, values)
        sent = sum(r["values"][f"{case}.ring_bytes"] for r in reports)
        assert sent == sum(r["values"][f"{case}.ring_bytes_read"] for r in reports), case  # 2 x sent + received
        assert (sent > 0) == (case != "whole"), (case, sent)


def test_a_rank_passing_another_batch_is_refused_on_every_rank(reports):
    for report in reports:
        kind, message = report["errors"]["other_batch"]
        assert kind == "ValueError", message
        for text in ("PrepareContextParallel(pool=True) pool", "rank 1: batch 2 x 509 tokens",
                     "must pass the global batch", "or drop pool=True"):
            assert text in message, (text, message)
        kind, message = report["errors"]["all2all"]
        assert kind == "ValueError" and "use backend='p2p'" in message, message
