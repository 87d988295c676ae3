"""pcp-bench (paddle_cp/tools/bench.py) run for real on CPU ranks, and the planner checked against what it measures."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paddle_cp import planner

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("efficiency", "kernel_util", "balance", "bytes_ratio", "mem_ratio")


def _bench(tmp_path_factory, *flags):
    out = tmp_path_factory.mktemp("bench") / "out.json"
    cmd = [sys.executable, "-m", "paddle_cp.tools.bench", "--iters", "1", "--warmup", "1", "--json", str(out), *flags]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[bench_cp] seq" in proc.stderr  # progress is shown while it runs
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def causal_two(tmp_path_factory):
    return _bench(tmp_path_factory, "--nproc", "2", "--seq", "256", "--causal")


@pytest.fixture(scope="module")
def gqa_four(tmp_path_factory):
    return _bench(tmp_path_factory, "--nproc", "4", "--seq", "128", "--heads", "4", "--kv-heads", "2")


def _cases(result):
    return {case["backend"]: case for case in result["cases"]}


def _shape(result, case):
    c = result["config"]
    return (c["batch"], case["seq"], c["heads"], c["kv_heads"], c["head_dim"])


def test_bench_reports_sane_ratios(causal_two, gqa_four):
    for result in (causal_two, gqa_four):
        assert set(_cases(result)) == {"p2p", "all2all"}
        for case in result["cases"]:
            for metric in METRICS:
                assert math.isfinite(case[metric]) and case[metric] > 0, (case["backend"], metric, case[metric])
            assert case["mem_ratio"] < 1, case  # a shard needs less memory than the whole sequence


def test_bench_balance(causal_two):
    for case in causal_two["cases"]:
        assert case["balance"] == pytest.approx(1.0)


def test_bench_bytes_ratio_is_the_analytic_one(causal_two, gqa_four):
    for result, n in ((causal_two, 2), (gqa_four, 4)):
        cases = _cases(result)
        assert cases["p2p"]["bytes_ratio"] == pytest.approx((3 * n - 2) / (3 * n - 3))
        assert cases["all2all"]["bytes_ratio"] == pytest.approx(1.0)


def test_planner_bytes_equal_measured_bytes(causal_two, gqa_four):
    for result, n in ((causal_two, 2), (gqa_four, 4)):
        for backend, case in _cases(result).items():
            assert case["bytes_per_rank"] == planner.attention_bytes(backend, *_shape(result, case), n)


def test_planner_held_memory_ratio_matches_measured(causal_two, gqa_four):
    for result, n in ((causal_two, 2), (gqa_four, 4)):
        for backend, case in _cases(result).items():
            shape = _shape(result, case)
            predicted = planner.attention_held_bytes(backend, *shape, n) / planner.attention_held_bytes(backend, *shape, 1)
            assert case["held_ratio"] == pytest.approx(predicted, rel=0.02), (backend, n)