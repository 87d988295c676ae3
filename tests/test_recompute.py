"""Recomputation under context parallelism: PaddleFormers' own flags and fleet.utils.recompute around
each attention (reentrant and not), 3 AdamW steps vs one card without recomputation (fp32, 1e-5)."""
import pytest
from launcher import launch
from test_context_parallel import assert_close

pytest.importorskip("paddleformers")


@pytest.mark.parametrize("world", [2, 4])
def test_recomputed_llama_trains_like_one_card(world):
    reports = launch("recompute_parity.py", world)
    assert_close(reports)
    runs = reports[0]["values"]["runs"]
    styles = {run.split(".", 4)[-1].replace(".accumulate", "") for run in runs}
    assert {"layers", "attn.reentrant", "attn.plain"} <= styles
    assert any("hybrid" in run for run in runs) == (world == 4)
    assert any(run.endswith(".accumulate") for run in runs)
    for run in runs:
        assert {f"{run}.{kind}" for kind in ("loss", "grad", "param")} <= set(reports[0]["max_abs"])
        losses = reports[0]["values"][f"{run}.losses"]
        assert losses[-1] < losses[0], "training should reduce the loss"
