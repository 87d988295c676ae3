"""pcp-selftest (paddle_cp/tools/selftest/) on 4 CPU ranks. Started by its own launcher (the console script's
path): it passes and prints its table (fp32 and the blockwise kernel: the CPU matmul takes no bf16). Inside a
launch (one launch, tests/workers/selftest_in_launch.py): on the GPU path with emulated flash ops (bf16 checks,
the flash and flashmask kernels), then with a fault planted, where every rank exits non-zero and the table names
the failed checks. A fault on one rank only (tests/workers/selftest_one_rank_fault.py, a launch each): every rank
ends with exit 1 without waiting out a collective timeout. Real flash kernels, NCCL and GPU bandwidth run on a GPU
only (docs/tools.md)."""
import json
import re
import sys

import pytest
from launcher import launch_failing, run_tool

FLAGS = ("--nproc", "4", "--seq", "96", "--iters", "2")
GLOO_TIMEOUT_S = 25  # gloo gives up after 30 s (PADDLE_API.md)


@pytest.fixture(scope="module")
def passed(tmp_path_factory):
    out = tmp_path_factory.mktemp("selftest") / "out.json"
    cmd = [sys.executable, "-m", "paddle_cp.tools.selftest", *FLAGS, "--json", str(out)]
    proc = run_tool(cmd, timeout=300)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_selftest_passes_on_cpu_ranks_and_prints_its_table(passed):
    proc, result = passed
    assert proc.returncode == 0 and result is not None, proc.stdout + proc.stderr[-3000:]
    assert result["passed"] and result["config"]["device"] == "cpu" and result["config"]["dtypes"] == ["float32"]
    assert result["config"]["not_run"] == ["bfloat16: this device's matmul takes none"]
    assert [(c["backend"], c["dtype"]) for c in result["checks"]] == [
        ("p2p", "float32"), ("all2all", "float32"), ("hybrid", "float32")]
    for check in result["checks"]:
        assert check["passed"] and max(check["errors"].values()) <= 1e-5 and check["tolerance"] == 1e-5, check
        assert 0 < max(check["errors"].values()) and 0 < max(check["one_device"].values()) <= 1e-5, check
        for kernels, ops in zip(check["kernels_per_rank"], check["ops_per_rank"]):
            assert list(kernels) == ["blockwise"], kernels  # fp32: flash kernels take half precision only
            assert kernels["blockwise"]["forward"] >= 1 and kernels["blockwise"]["backward"] >= 1, kernels
            assert ops["calls"] > ops["in_dtype"] > 0 and ops["attention_ops"] == {}, ops
    calls = [r["blockwise"]["forward"] for r in result["checks"][0]["kernels_per_rank"]]
    assert min(calls) >= 1 and max(calls) <= 4, calls  # p2p: at most one call per ring step (4 ranks)
    for name, sent in (("ring", 2 ** 20), ("all_to_all", 3 * 2 ** 20 // 4)):
        exchange = result["exchanges"][name]
        assert exchange["delivered"] and exchange["bytes_per_rank"] == sent and exchange["bytes_per_second"] > 0
    table = proc.stdout
    assert "pcp-selftest: 4 rank(s) on cpu" in table and table.rstrip().endswith("PASSED"), table
    for row in ("p2p       float32", "all2all   float32", "hybrid    float32", "ring  ", "all_to_all"):
        assert row in table, (row, table)


@pytest.fixture(scope="module")
def in_launch():
    """(exit code, rank logs, {"emulated": the GPU path's result, "selftest": the faulty run's})."""
    return launch_failing("selftest_in_launch.py", 4, *FLAGS)


def test_selftest_holds_bf16_to_one_device_on_the_emulated_gpu_path(in_launch):
    """The flash and flashmask kernels over emulated ops (the GPU kernels' bf16 rounding): bf16 errors of
    rounding size, within 2x one device's own or one bf16 rounding; fp32 still on the blockwise kernel."""
    result = in_launch[2]["emulated"]
    assert result["passed"] and result["config"]["dtypes"] == ["bfloat16", "float32"], result["table"]
    for check in result["checks"]:
        kernels = {name for per_rank in check["kernels_per_rank"] for name in per_rank}
        worst, one_device = max(check["errors"].values()), max(check["one_device"].values())
        if check["dtype"] == "bfloat16":
            assert "flashmask" in kernels and kernels <= {"flash", "flashmask"}, check  # documents cut tiles
            assert check["tolerance"] == max(2 ** -8, 2 * one_device), check
            assert 1e-4 < worst <= check["tolerance"] and 1e-4 < one_device < 2e-2, check
        else:
            assert kernels == {"blockwise"} and worst <= 1e-5, check
    assert "bfloat16  " in result["table"] and "flashmask" in result["table"]


def test_selftest_fails_on_a_fault_on_every_rank(in_launch):
    """The ranks' exchanges in bfloat16 (a planted fault): every backend fails by rounding-sized errors, the
    table says FAILED, and the launch exits non-zero."""
    code, logs, written = in_launch
    result = written["selftest"]
    assert code != 0 and not result["passed"], code
    failed = {c["backend"] for c in result["checks"] if not c["passed"]}
    assert failed == {"p2p", "all2all", "hybrid"}, result["checks"]
    for check in result["checks"]:
        assert 1e-5 < max(check["errors"].values()) < 1e-1, check  # rounding-sized, and still caught
    assert all(e["delivered"] for e in result["exchanges"].values())  # integers pass a bf16 transport
    log = logs["workerlog.0"]
    assert "FAILED" in log[log.find("pcp-selftest: 4 rank(s)"):], log[-3000:]


def _no_rank_waited(logs):
    """No rank waited out a timeout: neither the watchdog's ("waited") nor gloo's own 30 s, which paddle_cp's guard
    reports as "failed after <seconds> s" (a collective failing because a peer exited fails within a second)."""
    for name, log in logs.items():
        assert "waited" not in log, (name, log[-3000:])
        waits = [float(s) for s in re.findall(r"failed after (\d+\.\d) s", log)]
        assert all(s < GLOO_TIMEOUT_S for s in waits), (name, waits, log[-3000:])


def test_a_case_failing_on_one_rank_skips_its_checks_on_every_rank():
    """Rank 1 cannot build the fp32 case (no collectives yet): the ranks agree on it in one all-reduce, every rank
    skips the case's checks (none waits in their exchanges for rank 1), reports and exits 1."""
    code, logs, written = launch_failing("selftest_one_rank_fault.py", 4, "case", *FLAGS, timeout=240)
    assert code != 0 and [written.get(f"exit{r}") for r in range(4)] == [{"code": 1}] * 4, (code, written)
    result = written["selftest"]
    assert not result["passed"] and [c["backend"] for c in result["checks"]] == ["one device"], result["checks"]
    assert result["checks"][0]["error"] == "on rank(s) [1]: RuntimeError: planted fault: the case cannot be built " \
                                           "on rank 1", result["checks"][0]
    assert "FAILED" in logs["workerlog.0"]
    assert not any("paddle_cp: rank" in log for log in logs.values())  # no collective failed: none was left waiting
    _no_rank_waited(logs)


def test_a_kernel_failing_on_one_rank_mid_exchange_ends_the_run_at_once():
    """Rank 1's kernel raises in the ring check while its peers wait in that check's exchanges: rank 1 reports
    and exits 1 at once, and the others end with it (their exchanges fail, or the launcher stops them); no rank
    waits out a collective timeout (the watchdog's report) and the launch completes within the harness's limit."""
    code, logs, written = launch_failing("selftest_one_rank_fault.py", 4, "kernel", *FLAGS, timeout=240)
    assert code != 0 and "selftest" not in written, (code, written)
    log = logs["workerlog.1"]
    assert "p2p attention in float32 FAILED: RuntimeError: planted fault: the kernel failed on rank 1" in log, log[-3000:]
    assert "FAILED (rank 1 ends the run, exit 1)" in log
    _no_rank_waited(logs)
