"""ConvParallel (a Conv2D's input split along its width over mp) vs one card: one 4-rank launch
(tests/workers/conv_parallel.py) trains a small conv net on mp=4 and dp=2 x mp=2, NCHW and NHWC."""
import pytest
from launcher import launch_once

TOLERANCE = 1e-5
RUNS = ["mp4_NCHW", "mp4_NHWC", "dp2xmp2_NCHW", "dp2xmp2_NHWC"]
PER_SAMPLE_HALO_BYTES = 4 * (3 * 8 * (1 + 1) + 8 * 4 * (1 + 2))  # fp32: conv1 [3, H 8] x 1|1, conv2 [8, H 4] x 1|2


@pytest.fixture(scope="module")
def reports():
    return launch_once("conv_parallel.py", 4)


@pytest.mark.parametrize("run", RUNS)
def test_conv_net_trains_like_one_card(reports, run):
    for report in reports:
        assert "crash" not in report["values"], report["values"].get("crash")
        assert report["values"][f"{run}.state_keys_match"]
        diffs = {k[len(run) + 1:]: v for k, v in report["max_abs"].items() if k.startswith(run + ".")}
        for kind in ("loss", "logits", "x_grad", "grad.conv1.weight", "grad.conv2.bias", "grad.head.weight",
                     "state.conv3.weight"):
            assert kind in diffs, f"{run}: no {kind} measured"
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < TOLERANCE, (run, worst, diffs[worst])


@pytest.mark.parametrize("run", RUNS)
def test_each_rank_sends_exactly_its_halos(reports, run):
    samples = 4 if run.startswith("mp4") else 2  # the dp ranks each hold half the batch
    for report in reports:
        assert report["values"][f"{run}.halo_bytes_one_forward"] == samples * PER_SAMPLE_HALO_BYTES


@pytest.mark.parametrize("run", ["mp4_NCHW", "mp4_NHWC"])
def test_width_not_divisible_is_refused_on_every_rank(reports, run):
    for report in reports:
        kind, message = report["errors"][f"{run}.width_not_divisible"]
        assert kind == "ValueError" and "not divisible by mp=4" in message, (kind, message)
