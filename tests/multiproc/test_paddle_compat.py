"""Scripts written for Paddle's intermediate API, unchanged but for `pcp.patch_paddle()` (or paddle_cp's calls
with Paddle's plan objects), vs one card: PaddleFormers Llama in the shape of Paddle's parallel-API test
(tests/workers/paddle_parallel_api.py, one 4-rank launch of many configs, the mesh sweep's 4-rank meshes among
them), the two seed examples and Paddle's ConvParallel."""
import pytest
from launcher import launch_once
from workers.mesh_layouts import WORLDS

TOLERANCE = 1e-5
RUNS = ["dp2xmp2_two_step_acc2_group", "dp2xmp2_sp_pcp", "dp2xmp2_shared_emb", "dp2xmp2_prepare_io_amp_o2",
        "mp2xsep2_sp_two_step", "mp2xsep2_all2all_pcp", "dp2xmp2_lora_two_step", "dp2xsep2_l1_lora", "dp4_l2_two_step_pcp", "dp4_l3_acc2",
        "mp2xpp2", "dp2xpp2_two_step"]
SEEDS = ["seed_parallelize", "seed_prepare_cp_p2p", "seed_prepare_cp_all2all", "paddle_conv_parallel"]
# Paddle's use_lazy_init and fp16 GradScaler switches (lazy init and pcp.shard_scaler)
LAZY_AND_SCALER = ["dp2xmp2_lazy", "mp2xsep2_sp_lazy_acc2", "dp2xpp2_lazy_lora", "dp2xsep2_amp_fp16_scaler",
           "mp2xsep2_amp_fp16_scaler_pcp"]


# the worker's groups of 4-rank runs, one launch for all (tests/multiproc/test_mesh_sweep.py's 4-rank meshes too)
FOUR_RANK_GROUPS = ("four", "lazy_and_scaler") + (("sweep4",) if 4 in WORLDS else ())


def four_rank_reports():
    pytest.importorskip("paddleformers")
    return launch_once("paddle_parallel_api.py", 4, *FOUR_RANK_GROUPS)


def _check(reports, run):
    for report in reports:
        assert "crash" not in report["values"], report["values"].get("crash")
        assert run not in report["errors"], report["errors"].get(run)
        if f"{run}.patched" in report["values"]:  # the patch route: Paddle's names ran paddle_cp
            assert report["values"][f"{run}.patched"]
        assert report["values"].get(f"{run}.state_keys_match", True), run
        assert not report["values"].get(f"{run}.misplaced"), report["values"][f"{run}.misplaced"]  # Paddle's check_mp
        diffs = {k: v for k, v in report["max_abs"].items() if k.startswith(run + ".")}
        assert {f"{run}.loss", f"{run}.param"} <= set(diffs), f"no measurements for {run}"
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < TOLERANCE, (worst, diffs[worst])


@pytest.mark.parametrize("run", RUNS + SEEDS)
def test_paddle_scripts_match_one_card(run):
    _check(four_rank_reports(), run)


@pytest.mark.parametrize("run", LAZY_AND_SCALER)
def test_lazy_init_and_scaler_switches_match_one_card(run):
    _check(four_rank_reports(), run)
