"""paddle_cp's PaddleFormers Trainer (paddle_cp.integrations.paddleformers) on 4 CPU ranks vs
PaddleFormers' own Trainer in one process: each logged loss and the final parameters.

One launch per group of tests/workers/trainer_parity.py; the one-card reference is
trained in the same launch (rank 0, after the parallel runs).
"""
import pytest
from launcher import launch_once

TOLERANCE = 1e-5
from test_hybrid_models import TRUTH_FACTOR  # Qwen3-Next's runs: paddle_cp vs one card, from the truth


def _reports(group):
    pytest.importorskip("paddleformers")
    pytest.importorskip("jinja2")
    return launch_once("trainer_parity.py", 4, group)


def check_parity(reports, run):
    for report in reports:
        assert "crash" not in report["values"], report["values"].get("crash")
    rank0 = reports[0]
    assert rank0["values"][f"{run}.state_keys_match"], run
    losses, want = rank0["values"][f"{run}.losses"]
    assert len(losses) == len(want) > 0, (losses, want)
    truth = rank0["values"].get(f"{run}.truth")
    if truth:  # a model amplifying fp32 rounding: as close to its float64 truth as one card's two evaluations
        for kind in ("loss", "state"):
            one_card = max(truth["one_card"][kind], truth["rechunked"][kind])
            assert truth["paddle_cp"][kind] <= max(TOLERANCE, TRUTH_FACTOR * one_card), (run, kind, truth)
            assert one_card < 1e-3, (run, kind, truth)  # measured 1.8e-4: a broken truth cannot widen the bound
        return
    for name in (f"{run}.loss", f"{run}.state"):
        assert rank0["max_abs"][name] < TOLERANCE, (name, rank0["max_abs"][name], losses, want)


@pytest.mark.parametrize("run", ["dp2_cp2", "dp2_ulysses2", "hybrid_ring2_ulysses2", "dp2_cp2_packed_accum",
                                 "dp2_mp2_sharding3", "user_config_dp2_ulysses2", "phi3_dp2_mp2",
                                 "ernie_ring2_ulysses2", "ernie_dp2_mp2_sp", "qwen3_next_dp2_cp2", "qwen3_vl_dp2_cp2",
                                 "glm4v_moe_ulysses4"])
def test_context_parallel_trainer_matches_one_card(run):
    """dp2_cp2 also compares evaluate()'s eval_loss (appended to its losses)."""
    check_parity(_reports("core"), run)


@pytest.mark.parametrize("run", ["mp2_sp_cp2", "dp2_sharding2_cp2", "cp2_recompute_chunked_loss_sharding3",
                                 "pp2_cp2_accum", "gemma3_dp2_cp2", "qwen3_moe_ep4_dp2_cp2", "qwen3_moe_dp2_mp2_sp",
                                 "pp2_mp2_sp", "qwen3_next_dp2_ulysses2", "resume_hybrid_to_dp2_ulysses2"])
def test_composed_trainer_matches_one_card(run):
    """tensor + sequence + context parallel; sharding stage 2 over dp x ring; PaddleFormers' recompute
    and chunked loss under ring with sharding stage 3 over dp x ring; Gemma3 under dp x ring; Qwen3-MoE's experts
    over expert groups of 4 (use_expert_parallel), and Qwen3-MoE under dp x tensor + sequence parallel; two
    pipeline stages with ring inside and gradient accumulation, and with tensor + sequence parallel; Qwen3-Next
    (attention and Gated DeltaNet) under dp x Ulysses (under dp x ring in the core group); saved on ring x
    Ulysses, resumed on dp x Ulysses. All on default (eager) builds."""
    check_parity(_reports("composed"), run)


def test_offload_and_tiles_from_training_arguments_train_like_one_card():
    """offload_recompute_inputs and mlp_tile_tokens on dp2 x ring2 with PaddleFormers' full recompute, and
    tensorwise_offload_optimizer (paddle_cp's host optimizer state, sharding stage 1; PaddleFormers' own
    NotImplementedError under data parallel and its process-wide adamw_ patch do not apply): the same losses and
    state as PaddleFormers' own Trainer on one card without them; offload without full recompute, refused."""
    reports = _reports("memory")
    check_parity(reports, "dp2_cp2_recompute_offload_tiled")
    check_parity(reports, "dp2_cp2_sharding1_offload_optimizer")
    for report in reports:  # tensorwise_offload_optimizer: paddle_cp's host state, not PaddleFormers' patch
        offload = report["values"]["dp2_cp2_sharding1_offload_optimizer.offload"]
        assert offload == {"host_state": True, "flag_reads": False, "adamw_is_paddles": True}, offload
    for report in reports:
        kind, message = report["errors"]["offload_without_recompute"]
        assert kind == "ValueError" and "recompute_granularity" in message and "'full'" in message
        kind, message = report["errors"]["negative_tile"]
        assert kind == "ValueError" and "mlp_tile_tokens" in message


AMP_SET_UP = {"amp_master_grad": False, "scaler_sharded": True, "autocast": True}


@pytest.mark.parametrize("run, master_grad", [("bf16_o2_master_grad_dp2_sharding2_cp2_accum", True),
                                              ("bf16_o1_dp2_mp2_sp", False)])
def test_bf16_trainer_matches_paddleformers_one_card(run, master_grad):
    """bf16 O2 with master gradients (accumulation, sharding stage 2 over dp x ring) and bf16 O1 without (tensor +
    sequence parallel): PaddleFormers' AMP is a no-op on CPU for both Trainers, so paddle_cp's must train exactly
    like PaddleFormers' own on one card. PaddleFormers' main_grad and its extra all-reduce over every rank are off:
    amp_master_grad becomes paddle_cp's flag; the scaler reduces and agrees over the mesh (pcp.shard_scaler)."""
    reports = _reports("memory")
    check_parity(reports, run)
    for report in reports:
        amp = report["values"][f"{run}.amp"]
        assert amp == dict(AMP_SET_UP, paddle_cp_master_grad=master_grad, amp_dtype="bfloat16", grad_scaling=False), amp


def test_bf16_o2_trainer_in_emulated_amp_is_as_close_to_fp32_as_one_card():
    """Under the CPU emulation of Paddle's GPU AMP (tests/workers/emulated_amp.py: bf16 parameters cast by
    decorate, every kernel computing in fp32 and rounding its output to bf16, Paddle's master-gradient cast):
    bf16 O2 with master gradients on dp 2 x ring 2 is no farther from one card's fp32 run than twice one card's
    own bf16 O2 run (losses and parameters after 3 steps); the parameters trained were bf16."""
    reports = _reports("memory")
    for report in reports:
        assert report["values"]["emulated_bf16_o2_dp2_cp2.param_dtypes"] == ["paddle.bfloat16"]
    distances = reports[0]["values"]["emulated_bf16_o2_dp2_cp2.emulated"]
    for kind in ("loss", "state"):
        one_card = distances["one_card"][kind]
        assert 1e-4 < one_card < 0.1, (kind, distances)  # bf16 visibly not fp32: the emulation ran
        assert distances["paddle_cp"][kind] <= 2 * one_card, (kind, distances)


def test_fp16_trainer_is_set_up_like_paddleformers():
    """fp16 O2: PaddleFormers' loss scaling on, its scaler through pcp.shard_scaler, master gradients paddle_cp's.
    (Not trained here: on CPU Paddle disables the GradScaler, and PaddleFormers' own Trainer then fails reading the
    found-inf flag the disabled scaler never sets.)"""
    for report in _reports("memory"):
        amp = report["values"]["fp16_o2_set_up"]
        assert amp == dict(AMP_SET_UP, paddle_cp_master_grad=True, amp_dtype="float16", grad_scaling=True), amp


def test_save_model_loads_with_from_pretrained():
    rank0 = _reports("composed")[0]
    assert rank0["values"]["dp2_sharding2_cp2.export_keys_match"]
    assert rank0["max_abs"]["dp2_sharding2_cp2.export"] < TOLERANCE


def test_a_step_failing_on_every_attempt_stops_the_trainer_job_with_one_message():
    """Each train() call an attempt of the job in output_dir (as each restart by Paddle's launch is): step 3 raises
    on every rank in the first two, the second resumed after the step-2 checkpoint; the third stops the job at its
    start (tries_per_step=2) with the step and the first error instead of training again."""
    reports = _reports("core")
    loop = reports[0]["values"]["crash_loop"]
    assert all(report["values"]["crash_loop"]["outcomes"] == ["BadSample", "BadSample", "JobStopped"]
               for report in reports), [report["values"]["crash_loop"] for report in reports]
    assert loop["resumed"] == [0, 2, 2] and loop["stopped"] == [3], loop
    assert loop["failed_at"] == [[3], [3], []] and loop["failed_ranks"] == [4, 4, 0], loop
    message = loop["printed"][0]
    assert message.startswith("paddle_cp: step 3 failed in each of the last 2 attempts (attempts 1-2, the last "
                              "resumed after step 2)"), message
    assert "BadSample: a bad sample in step 3" in message, message


@pytest.mark.parametrize("case, words", [
    ("degrees_do_not_fit", ["context_parallel_size 3", "must divide the world size"]),
    ("sharding_size", ["sharding_parallel_size 3", "set sharding_parallel_size to 4", "or 2 (the dp ranks only)"]),
    ("sequence_parallel_alone", ["tensor_model_parallel_size > 1"]),
    ("config_and_flags", ["paddle_cp_config", "context_parallel_size"]),
    ("uncovered_model", ["Linear", "self_attn", "paddle_cp_config"]),
    ("stage3_accumulation", ["stage3", "gradient_accumulation_steps", "stage2"]),
    ("expert_size_alone", ["expert_model_parallel_size 2", "use_expert_parallel=True"]),
    ("expert_size_not_dividing", ["expert_model_parallel_size 4", "the 2 data x context parallel ranks"]),
])
def test_bad_configs_raise_the_same_error_on_every_rank(case, words):
    reports = _reports("core")
    errors = [report["errors"][case] for report in reports]
    assert all(error == errors[0] for error in errors), errors
    kind, message = errors[0]
    assert kind == "ValueError", errors[0]
    for word in words:
        assert word in message, (word, message)
