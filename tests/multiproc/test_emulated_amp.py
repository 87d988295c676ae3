"""bf16 O2 with master gradients through paddle_cp, in the CPU emulation of Paddle's AMP
(tests/workers/emulated_amp.py), against one card in the same emulation and an fp32 run: one 4-rank launch
(tests/workers/emulated_amp_parity.py)."""
import pytest
from launcher import launch_once

RUNS = ["dp4_l0_after", "dp2xmp2_sp_l1_before", "dp2xmp2_l2_after", "dp4_l3_before", "dp4_l3_after",
        "dp4_l2_host_optimizer", "sep4_ring_after", "dp2xsep2_ulysses_before", "sep4_hybrid_tiles_l2_after",
        "sep4_ring_recompute_offload_before"]


@pytest.fixture(scope="module")
def reports():
    pytest.importorskip("paddleformers")
    reports = launch_once("emulated_amp_parity.py", 4)
    for report in reports:
        assert "crash" not in report["values"], report["values"]["crash"]
    return reports


def _yardstick(report):
    own = dict(report["values"]["one_card"])
    own["loss"] = max(own["loss"], report["values"]["loss_half_ulp"])  # the losses are bf16 values
    return own


@pytest.mark.parametrize("run", RUNS)
def test_within_twice_one_cards_own_distance_from_fp32(reports, run):
    """Losses, the first step's reduced gradients (level 0) and the fp32 master weights after the steps: as far
    from an fp32 run as one card in the same emulation is, within 2x."""
    for report in reports:
        own, distance = _yardstick(report), report["values"][f"{run}.distance"]
        for metric, value in distance.items():
            assert value <= 2 * own[metric], (metric, value, own[metric])
        assert own["grad"] > 1e-3 and own["weights"] > 1e-2  # bf16 really ran: one card is far from fp32
        assert report["values"]["one_card.dtypes"] == ["float32"]  # master gradients


def test_master_gradients_reduce_in_fp32(reports):
    """dp4 at levels 0 and 3: each reduced gradient is the fp32 mean of the ranks' fp32 local gradients (1e-6
    relative); the reduction moves 4 bytes an element. Without master gradients it moves 2 and costs precision; a planted
    bf16 reduction of master gradients fails the check."""
    for report in reports:
        values = report["values"]
        assert values["master.local_grad_dtypes"] == ["paddle.float32"]
        assert values["master.reduced_vs_fp32_mean"] <= 1e-6
        assert values["master.bytes_per_element"] == 4.0
        assert values["no_master.local_grad_dtypes"] == ["paddle.bfloat16"]
        assert values["no_master.bytes_per_element"] == 2.0
        assert values["no_master.reduced_vs_fp32_mean"] > 1e-3
        assert values["planted.reduced_vs_fp32_mean"] > 1e-3  # the check fails on a bf16 reduction
        # buckets cut at parallelize by fp32 sizes (decorate after it), cut again by the reduced gradients' dtype
        # level 3: reduce-scattered onto owners (each holds the reduced gradients it owns), non-owners' stashed
        # gradients accumulated and sent in fp32
        assert values["master_l3.reduced_vs_fp32_mean"] <= 1e-6 and values["master_l3.reduced_here"] > 0
        assert values["master_l3.local_grad_dtypes"] == ["paddle.float32"]
        assert values["no_master_l3.reduced_vs_fp32_mean"] > 1e-3
        assert abs(values["master_l3.bytes_per_element"] - 4) < 0.01  # gloo sends an empty chunk as one zero
        assert abs(values["no_master_l3.bytes_per_element"] - 2) < 0.01
        master, bf16 = values["master.buckets"], values["no_master.buckets"]
        assert master["first_step"] == master["after"] == master["planned_now"] == bf16["first_step"]
        assert bf16["after"] == bf16["planned_now"] < bf16["first_step"]


def test_bf16_checkpoint_resumes_on_another_mesh(reports):
    """Saved on dp2 x mp2 at level 2, loaded on dp4 at level 3 and saved again at once: the same files (20 fp32
    master weights, moments, bf16 parameters); one more step on each mesh agrees as two meshes do."""
    for report in reports:
        values = report["values"]
        files = values["ckpt.files_equal"]
        assert all(part["keys_equal"] and part["max_abs"] == 0.0 for part in files.values()), files
        assert files["optimizer_state"]["masters"] == 20
        assert values["ckpt.resumed_vs_uninterrupted"] <= 2 * max(
            values[f"{run}.weights_vs_bf16_card"] for run in RUNS)


def test_fp32_checkpoint_into_an_o2_run_gives_its_master_weights(reports):
    for report in reports:
        values = report["values"]
        assert values["fp32_into_o2.masters"] == 20 and values["fp32_into_o2.master_vs_fp32_param"] == 0.0
        assert values["fp32_into_o2.model_dtypes"] == ["paddle.bfloat16"]


def test_gloo_float16_all_reduce_is_summed_in_fp32(reports):
    """Paddle's gloo float16 all_reduce gives inf for 1 + 2 + 3 + 4; paddle_cp's comm layer widens it (counted),
    the bytes counted as NCCL moves them (float16: 3 elements x 2 bytes x 2(n-1)/n)."""
    for report in reports:
        values = report["values"]
        assert values["gloo.float16"] == values["gloo.bfloat16"] == [10.0, 2.0, -18.0]
        assert values["gloo.raw_float16"] != 10.0
        assert values["gloo.widened"] == {"probe_float16": 1}
        assert values["gloo.bytes"] == {"probe_float16": 9, "probe_bfloat16": 9}


def test_float16_gradients_reduce_through_gloo(reports):
    """fp16 O2 without master gradients: dp4's buckets all-reduce float16 on gloo, widened by the comm layer (a
    plain gloo float16 all-reduce would give inf); the reduced gradient is the fp32 mean within fp16 rounding."""
    for report in reports:
        values = report["values"]
        assert values["fp16_no_master.local_grad_dtypes"] == ["paddle.float16"]
        assert values["fp16_no_master.reduced_vs_fp32_mean"] < 1e-2
        assert values["fp16_no_master.bytes_per_element"] == 2.0
        assert values["fp16_no_master.widened"]["grad_all_reduce"] == values["fp16_no_master.reduction_calls"] > 0


def test_mix_precision_layer_main_grad_is_refused(reports):
    for report in reports:
        kind, message = report["errors"]["main_grad"]
        assert kind == "ValueError" and "master_grad=True" in message
