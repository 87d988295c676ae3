"""Long-context training: recomputation under context parallelism (PaddleFormers' own flags and
fleet.utils.recompute around each attention, reentrant and not) and PaddleFormers' chunked losses
(3 AdamW steps vs one card with neither, fp32, 1e-5), and no device-to-host reads inside the ring loop."""
import importlib.util

import pytest
from launcher import launch
from test_context_parallel import assert_close

needs_paddleformers = pytest.mark.skipif(importlib.util.find_spec("paddleformers") is None,
                                         reason="PaddleFormers is not installed")


def test_ring_loop_reads_nothing_from_the_device_but_dense_masks():
    reports = launch("host_syncs.py", 2)
    for report in reports:
        assert not report["values"].get("crash"), report["values"]["crash"]
        calls = {name: counts for name, counts in report["values"].items() if name != "crash"}
        assert len(calls) == 10
        for name, counts in calls.items():
            assert counts["blocks"] >= 2, name  # forward and backward, at least one ring step each
            if name.endswith(".dense"):
                assert 0 < counts["reads"] <= counts["blocks"], (name, counts)  # the wrapper sees reads
            else:
                assert counts.get("reads", 0) == 0, (name, counts)


@needs_paddleformers
@pytest.mark.parametrize("world", [2, 4])
def test_recomputed_and_chunked_loss_llama_trains_like_one_card(world):
    reports = launch("recompute_parity.py", world)
    assert_close(reports)
    runs = reports[0]["values"]["runs"]
    styles = {run.split(".", 4)[-1].replace(".accumulate", "").rsplit(".", 1)[0] for run in runs}
    assert {"layers", "attn.reentrant", "attn.plain", "None"} <= styles
    assert {run.replace(".accumulate", "").rsplit(".", 1)[-1] for run in runs} == {"None", "subbatch", "fused"}
    assert any("hybrid" in run for run in runs) == (world == 4)
    assert any(run.endswith(".accumulate") for run in runs)
    for run in runs:
        assert {f"{run}.{kind}" for kind in ("loss", "grad", "param")} <= set(reports[0]["max_abs"])
        losses = reports[0]["values"][f"{run}.losses"]
        assert losses[-1] < losses[0], "training should reduce the loss"
