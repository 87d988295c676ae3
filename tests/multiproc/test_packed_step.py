"""A tiny-heads model's training step on a packed row of short documents, under the layout the batch gets by
default and under 2N chunks (tests/workers/packed_step.py, one launch of 2 ranks): attention is planned once per
batch, not per layer or direction, and runs one kernel call per ring step, layer and direction. The step times it
records are for the note (docs/), never asserted."""
import pytest
from launcher import launch_once

RANKS = 2


@pytest.fixture(scope="module")
def reports():
    pytest.importorskip("paddleformers")
    # 2048 tokens of documents with lengths around 30, the first row of the stream; 2 timed steps
    return launch_once("packed_step.py", RANKS, 2048, 30, 0, 2)


def test_attention_is_planned_once_per_batch_and_called_once_per_ring_step(reports):
    for report in reports:
        values = report["values"]
        assert values["documents"] > 40, values["documents"]
        assert values["documents.moved"] and not values["chunks.moved"]  # the default layout is not the chunks
        for layout in ("documents", "chunks"):
            for counts in values[f"{layout}.counts"]:
                assert counts["masks"] == RANKS, (layout, counts)  # one per ring step, read by every layer
                # a kernel call per ring step, layer and direction (forward skips a step no query sees)
                assert values["layers"] * RANKS <= counts["kernel_calls"] <= 2 * values["layers"] * RANKS, counts
                assert counts["computed"] > 0
