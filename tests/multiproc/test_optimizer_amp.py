"""The optimizer and AMP calls Paddle's parallel-API scripts make, on a
PaddleFormers Llama, vs one card: one 4-rank launch (tests/workers/optimizer_amp.py)."""
import pytest
from launcher import launch_once

TOLERANCE = 1e-5
RUNS = ["dp2xmp2_l0", "dp2xmp2_l2", "dp2xmp2_l3", "sep2xdp2", "pp2xdp2_tied"]


@pytest.fixture(scope="module")
def reports():
    pytest.importorskip("paddleformers")
    reports = launch_once("optimizer_amp.py", 4, "groups")
    for report in reports:
        assert "crash" not in report["values"], report["values"]["crash"]
    return reports


def _worst(report, prefix):
    diffs = {k: v for k, v in report["max_abs"].items() if k.startswith(prefix + ".")}
    assert diffs, f"no measurements for {prefix}"
    worst = max(diffs, key=diffs.get)
    return worst, diffs[worst]


@pytest.mark.parametrize("run", RUNS)
def test_groups_clips_schedule_frozen_and_accumulation_match_one_card(reports, run):
    """Two groups with their own clip and decay, apply_decay_param_fun, LinearWarmup, a frozen parameter,
    2 accumulated micro-batches per step (`(loss / 2).backward()`; under pp2 each call runs a 1F1B schedule of
    2 micro-batches, tied embeddings on both stages): losses, learning rates and parameters after 3 steps
    within 1e-5; one gradient reduction per step (none in the backwards), at level 0 the reduced gradient
    equals one card's."""
    for report in reports:
        worst, error = _worst(report, run)
        assert error < TOLERANCE, (worst, error)
        values = report["values"]
        assert values[f"{run}.state_keys_match"] and values[f"{run}.frozen_unchanged"]
        assert values[f"{run}.reductions"] == 3, values[f"{run}.reductions"]  # 3 steps of 2 micro-batches
    if run in ("dp2xmp2_l0", "sep2xdp2", "pp2xdp2_tied"):
        assert all(f"{run}.step1.grad" in r["max_abs"] for r in reports)
        assert not any(r["values"][f"{run}.frozen_has_grad"] for r in reports)


@pytest.mark.parametrize("run", RUNS)
def test_state_dict_round_trip_replays_a_step_exactly(reports, run):
    for report in reports:
        trip = report["values"][f"{run}.state_dict_round_trip"]
        assert trip["lr_restored"] and trip["scheduler"] and trip["state_keys"] > 0, trip
        assert trip["params"] == 0.0 and trip["state"] == 0.0, trip


def test_default_adam_epsilon_differs_only_by_rounding(reports):
    """epsilon=1e-8: the parallel run is as far from one card as one card is from itself one ulp away."""
    for report in reports:
        spread = report["values"]["dp2xmp2_default_eps.rounding_spread"]
        assert spread["state"] > 0
        assert report["max_abs"]["dp2xmp2_default_eps.loss"] <= max(4 * spread["loss"], 1e-5)
        assert report["max_abs"]["dp2xmp2_default_eps.param"] <= 4 * spread["state"]


@pytest.mark.parametrize("run", ["scaler_dp2xsep2_l2", "scaler_dp2xmp2_l3"])
def test_shard_scaler_matches_one_card_and_all_ranks_skip_together(reports, run):
    """GradScaler's own logic (enabled on CPU) through pcp.shard_scaler: 3 steps equal one card's with the
    same scaler; an inf on rank 0 in a gradient only half the ranks hold makes every rank skip (the
    parameters do not move anywhere) and count it; the next finite step steps. Without the agreement the
    ranks disagree; a scaler not wrapped by shard_scaler is refused on every rank. Level 3: the gradients
    non-owners stash are reduced before Paddle unscales them."""
    for report in reports:
        worst, error = _worst(report, run)
        assert error < TOLERANCE, (worst, error)
        values = report["values"]
        agreed = values[f"{run}.inf_agreed"]
        assert agreed["found_inf"] and agreed["changed"] == 0.0 and agreed["decr_count"] == 1, agreed
        assert values[f"{run}.step_after_skip"]["changed"] > 0
        assert values[f"{run}.inf_not_agreed"]["changed"] != 0.0  # some rank stepped (onto NaN) while another skipped
        kind, message = report["errors"][f"{run}.unsharded_scaler"]
        assert kind == "ValueError" and "pcp.shard_scaler" in message
    assert len({str(r["values"][f"{run}.inf_agreed"]) for r in reports}) == 1
    assert len({r["values"][f"{run}.inf_not_agreed"]["found_inf"] for r in reports}) == 2


@pytest.mark.parametrize("run", ["master_weights_dp2xmp2_l2", "master_weights_dp2xmp2_l3"])
def test_checkpoints_carry_fp32_master_weights(reports, run):
    """dp2 x mp2 at sharding levels 2 and 3 (placeholders cast too), the model cast as decorate O2 casts it,
    multi_precision AdamW: the master weights and moments saved come back into a fresh optimizer exactly, on
    the ranks that own them; the files hold `{param}.w_0` (Paddle's sharded_state_dict name) in float32 at
    the single-card shape."""
    trainable = 19  # a tiny Llama's 20 parameters but the frozen one
    for report in reports:
        assert report["max_abs"][f"{run}.state"] == 0.0
        values = report["values"]
        assert values[f"{run}.model_dtypes"] == ["float16"]
        saved = values[f"{run}.saved_master_weights"]
        assert len(saved) == trainable and all(dtype == "float32" for _, _, dtype in saved)
        assert ["model.layers.0.self_attn.q_proj.weight.w_0", [64, 64], "float32"] in saved
        assert not any(v for k, v in values.items() if k.startswith(f"{run}.frozen_state_"))
    # levels 2-3: each dp rank holds the master weights of the parameters it owns, every one held once per mp rank
    by_mp = {}
    for report in reports:
        by_mp.setdefault(report["rank"] % 2, []).append(report["values"][f"{run}.master_weights_here"])
    assert all(sum(counts) == trainable for counts in by_mp.values()), by_mp
