"""dp_config offload_optimizer: the optimizer state on the host, each stepped parameter stepped
there by Paddle's own optimizer code, on PaddleFormers' Llama, dp2 x sep2 (ring), one 4-rank launch
(tests/workers/host_optimizer.py) against one card without offload."""
import pytest
from launcher import launch_once

TOLERANCE = 1e-5
LEVELS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def reports():
    pytest.importorskip("paddleformers")
    reports = launch_once("host_optimizer.py", 4)
    assert not [r["values"]["crash"] for r in reports if "crash" in r["values"]]
    return reports


def _errors(report, prefix):
    diffs = {k: v for k, v in report["max_abs"].items() if k.startswith(prefix + ".")}
    assert diffs, f"no measurements for {prefix}"
    return diffs


@pytest.mark.parametrize("run", [f"offload_l{level}" for level in LEVELS] + ["offload_pp2xdp2_tied"])
def test_offloaded_state_trains_like_one_card_at_every_sharding_level(reports, run):
    """Two parameter groups (own clip, decay, learning rate), apply_decay_param_fun, LinearWarmup, a frozen
    parameter, 2 accumulated micro-batches per step: 3 AdamW steps (epsilon 1e-3) with the state on the host give
    one card's losses, learning rates and parameters within 1e-5 at sharding levels 0-3 on dp2 x ring2 and under
    pp2 x dp2 (the tied embedding stepped on both stages); a state_dict round trip replays a step exactly."""
    for report in reports:
        for name, error in _errors(report, run).items():
            assert error < TOLERANCE, (name, error)
        values = report["values"]
        assert values[f"{run}.state_keys_match"] and values[f"{run}.frozen_unchanged"]
        trip = values[f"{run}.state_dict_round_trip"]
        assert trip["params"] == 0.0 and trip["state"] == 0.0 and trip["state_keys"] > 0, trip


@pytest.mark.parametrize("level", LEVELS)
def test_host_holds_the_state_of_the_parameters_the_rank_steps_and_each_step_moves_them_once(reports, level):
    """Every accumulator is in host memory (numpy, outside Paddle's allocator): two fp32 moments per stepped
    element and two step powers per parameter; sharded levels hold this rank's share (its owned parameters).
    Per step each stepped parameter's gradient and value go out once and its new value comes back once."""
    shares = []
    for report in reports:
        host = report["values"][f"offload_l{level}.host"]
        assert host["all_state_on_host"] and host["device_state"] == 0, host
        assert host["state_tensors"] == 4 * host["stepped"] > 0, host
        assert host["host_bytes"] == 2 * host["param_bytes"] + 2 * 4 * host["stepped"], host
        moved = report["values"][f"offload_l{level}.moved_per_step"]
        assert moved == {"to_host": 2 * host["stepped"], "to_host_bytes": 2 * host["param_bytes"],
                         "to_device": host["stepped"], "to_device_bytes": host["param_bytes"]}, moved
        assert report["values"][f"offload_l{level}.paddle_clips_per_step"] == 0  # not again per parameter
        shares.append(host["param_bytes"])
    whole = reports[0]["values"]["offload_l0.host"]["param_bytes"]
    if level == 0:
        assert set(shares) == {whole}
    else:  # four owners over dp x sep, greedy by size: each about a quarter
        assert sum(shares) == whole and max(shares) < 0.3 * whole, shares


def test_shard_scaler_skips_on_every_rank_with_offloaded_state(reports):
    """pcp.shard_scaler with the state on the host: 3 scaled steps equal one card's with the same scaler; an inf on
    rank 0 makes every rank skip (no parameter moves); the next finite step steps."""
    run = "offload_scaler_l2"
    for report in reports:
        for name, error in _errors(report, run).items():
            assert error < TOLERANCE, (name, error)
        agreed = report["values"][f"{run}.inf_agreed"]
        assert agreed["found_inf"] and agreed["changed"] == 0.0, agreed
        assert report["values"][f"{run}.step_after_skip"]["changed"] > 0


@pytest.mark.parametrize("run", ["checkpoint_host_to_device", "checkpoint_device_to_host"])
def test_checkpoints_move_between_offloaded_and_device_state(reports, run):
    """Saved with the state on the host (level 2), loaded without offload (level 1), and saved without (level 3),
    loaded with it (level 2): the loaded parameters are the saved ones and the next step's loss and parameters
    equal the saving run's continued step."""
    for report in reports:
        errors = _errors(report, run)
        assert errors[f"{run}.loaded"] == 0.0
        assert errors[f"{run}.loss"] < TOLERANCE and errors[f"{run}.param"] < TOLERANCE, errors
    assert all(r["values"]["checkpoint_device_to_host.loaded_on_host"] for r in reports)
    assert all(r["values"]["checkpoint_device_to_host.all_state_on_host"] for r in reports)


def test_fp32_master_weights_load_into_host_memory(reports):
    """optimizer_amp's master-weight checkpoint (a float16 model cast as decorate O2 casts it, multi_precision AdamW,
    dp2 x mp2 at level 2) saved without offload, loaded into a fresh optimizer with offload_optimizer: the host
    creates each owned parameter's fp32 master and moments, and they hold the saved values exactly."""
    run = "master_weights_to_host"
    by_mp = {}
    for report in reports:
        assert report["max_abs"][f"{run}.state"] == 0.0 and report["values"][f"{run}.state_on_host"]
        by_mp.setdefault(report["rank"] % 2, []).append(report["values"][f"{run}.master_weights_here"])
    assert all(sum(counts) == 19 for counts in by_mp.values()), by_mp  # every trainable parameter's, once per mp rank


@pytest.mark.parametrize("run", ["bf16", "bf16_cpuplace"])
def test_bfloat16_parameters_step_an_fp32_master_on_the_host(reports, run):
    """bfloat16 parameters, multi_precision AdamW: the host keeps an fp32 master (where checkpoints look for it) and
    steps it exactly as fp32 AdamW steps an fp32 copy on the same (bfloat16) gradients; the parameter is its
    bfloat16 rounding. Moved, cast to fp32 on the device first: the gradients out each step, the parameter once to
    make the master; the new fp32 value back, cast on the device (2 parameters, 3 steps). Also with the GPU's
    transport (CPUPlace tensors) run on CPU."""
    report = reports[0]
    for part in ("master", "param", "moments"):
        assert report["max_abs"][f"{run}.{part}"] == 0.0, (part, report["max_abs"][f"{run}.{part}"])
    values = report["values"]
    assert values[f"{run}.dtypes"] == ["paddle.bfloat16"] and values[f"{run}.on_host"]
    elements = 8 * 16 + 16
    assert values[f"{run}.moved"] == {"to_host": 3 * 2 + 2, "to_host_bytes": (3 + 1) * 4 * elements,
                                      "to_device": 3 * 2, "to_device_bytes": 3 * 4 * elements}, values[f"{run}.moved"]


def test_bad_settings_are_refused_on_every_rank(reports):
    for report in reports:
        errors = report["errors"]
        kind, message = errors["bad.not_bool"]
        assert kind == "ValueError" and "offload_optimizer must be True or False" in message
        kind, message = errors["bad.lamb"]
        assert kind == "ValueError" and "not Lamb" in message and "AdamW" in message
        kind, message = errors["bad.multi_tensor"]
        assert kind == "ValueError" and "use_multi_tensor=False" in message
