"""pcp-bench (paddle_cp/tools/bench/cli.py) run for real on CPU ranks, and the planner checked against what it measures."""
import json
import math
import sys

import pytest
from launcher import run_tool

from paddle_cp.cost import attention as attention_cost

METRICS = ("efficiency", "kernel_util", "balance", "bytes_ratio", "mem_ratio")


def _bench(tmp_path_factory, *flags):
    out = tmp_path_factory.mktemp("bench") / "out.json"
    cmd = [sys.executable, "-m", "paddle_cp.tools.bench", "--iters", "1", "--warmup", "1", "--json", str(out), *flags]
    proc = run_tool(cmd, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[pcp-bench] seq" in proc.stderr  # progress is shown while it runs
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def causal_two(tmp_path_factory):
    return _bench(tmp_path_factory, "--nproc", "2", "--seq", "256", "--causal")


@pytest.fixture(scope="module")
def gqa_four(tmp_path_factory):
    return _bench(tmp_path_factory, "--nproc", "4", "--seq", "128", "126", "--heads", "4", "--kv-heads", "2",
                  "--backend", "p2p", "all2all", "hybrid")  # 126: lengths that do not divide run too


def _cases(result):
    """{backend: case} at the first length, which divides evenly: there the planner's formulas are exact."""
    seq = result["cases"][0]["seq"]
    return {case["backend"]: case for case in result["cases"] if case["seq"] == seq}


def _shape(result, case):
    c = result["config"]
    return (c["batch"], case["seq"], c["heads"], c["kv_heads"], c["head_dim"])


EXPECTED_BACKENDS = {"causal_two": {"p2p", "all2all"}, "gqa_four": {"p2p", "all2all", "hybrid"}}


def test_bench_reports_sane_ratios(causal_two, gqa_four):
    for result, name in ((causal_two, "causal_two"), (gqa_four, "gqa_four")):
        assert {case["backend"] for case in result["cases"]} == EXPECTED_BACKENDS[name]
        for case in result["cases"]:
            for metric in METRICS:
                assert math.isfinite(case[metric]) and case[metric] > 0, (case["backend"], metric, case[metric])
            assert case["mem_ratio"] < 1, case  # a shard needs less memory than the whole sequence


def test_bench_balance(causal_two):
    for case in causal_two["cases"]:
        assert case["balance"] == pytest.approx(1.0)


def test_bench_sends_the_analytic_minimum(causal_two, gqa_four):
    """The ring's dk/dv make N-1 hops like k/v: every backend sends exactly its algorithm's minimum."""
    for result in (causal_two, gqa_four):
        for backend, case in _cases(result).items():
            assert case["bytes_ratio"] == pytest.approx(1.0), backend


def test_planner_bytes_equal_measured_bytes(causal_two, gqa_four):
    for result, n in ((causal_two, 2), (gqa_four, 4)):
        for backend, case in _cases(result).items():
            assert case["bytes_per_rank"] == attention_cost.attention_bytes(
                backend, *_shape(result, case), n, ulysses_degree=case["ulysses_degree"])


def test_planner_held_memory_ratio_matches_measured(causal_two, gqa_four):
    for result, n in ((causal_two, 2), (gqa_four, 4)):
        for backend, case in _cases(result).items():
            shape = _shape(result, case)
            degree = case["ulysses_degree"]
            predicted = (attention_cost.attention_held_bytes(backend, *shape, n, ulysses_degree=degree)
                         / attention_cost.attention_held_bytes(backend, *shape, 1))
            assert case["held_ratio"] == pytest.approx(predicted, rel=0.02), (backend, n)


@pytest.fixture(scope="module")
def gated_delta_two(tmp_path_factory):
    pytest.importorskip("paddleformers")
    return _bench(tmp_path_factory, "--mixer", "gated_deltanet", "--nproc", "2", "--seq", "130", "260",
                  "--hidden", "32", "--heads", "4", "--head-dim", "16")


def test_bench_gated_deltanet_layer(gated_delta_two):
    """pcp-bench --mixer gated_deltanet: both backends measured; on 2 ranks each sends its algorithm's minimum
    (one neighbour holds every halo); state passing sends as many bytes at 260 tokens as at 130."""
    cases = {(c["backend"], c["seq"]): c for c in gated_delta_two["cases"]}
    assert set(cases) == {(b, s) for b in ("p2p", "all2all") for s in (130, 260)}
    for case in cases.values():
        assert math.isfinite(case["efficiency"]) and case["efficiency"] > 0, case
        assert case["bytes_ratio"] == pytest.approx(1.0), case
    assert cases["p2p", 130]["bytes_by_tag"]["state_passing"] == cases["p2p", 260]["bytes_by_tag"]["state_passing"] > 0
    assert cases["all2all", 260]["bytes_per_rank"] > 1.9 * cases["all2all", 130]["bytes_per_rank"]


@pytest.fixture(scope="module")
def documents_four(tmp_path_factory):
    lengths = tmp_path_factory.mktemp("lengths") / "lengths.txt"
    lengths.write_text("200\n37\n150\n5\n60\n3\n57\n")  # one 512-token row; documents shorter than 2N included
    return _bench(tmp_path_factory, "--nproc", "4", "--seq", "512", "--heads", "2", "--backend", "p2p", "hybrid",
                  "--documents", str(lengths))


def test_bench_packed_documents_old_beside_new(documents_four):
    cases = {(c["backend"], c["layout"]): c for c in documents_four["cases"]}
    assert set(cases) == {(b, layout) for b in ("p2p", "hybrid") for layout in ("chunks", "documents")}
    for backend in ("p2p", "hybrid"):
        old, new = cases[backend, "chunks"], cases[backend, "documents"]
        assert old["balance"] > 1.2 and new["balance"] < old["balance"], (backend, old["balance"], new["balance"])
        # the GPU tile model's figures of the same batch: the chosen layout never slower than the chunks
        model = {row["layout"]: row for row in documents_four["gpu_model"] if row["backend"] == backend}
        assert set(model) == {"chosen", "chunks", "whole", "tiles", "across"}
        assert model["chosen"]["slowest_ms"] <= 1.01 * model["chunks"]["slowest_ms"], model
        # with the exchange priced on the links: the choice within a node and the one across (one rank a node)
        # never slower than the choice by tiles alone or the chunks there (but by the 1% tie rule)
        for pick, where in (("chosen", "step_within_ms"), ("across", "step_across_ms")):
            assert model[pick][where] <= 1.01 * min(model["tiles"][where], model["chunks"][where]), (pick, model)
        assert all(row["tokens_max"] <= 1.05 * row["tokens_mean"] + 2 * row["ring"] for row in model.values())
        for case in (old, new):
            assert case["causal"] and len(case["kernel_seconds"]) == 4
            assert math.isfinite(case["time_imbalance"]) and case["time_imbalance"] >= 1
            assert math.isfinite(case["efficiency"]) and case["efficiency"] > 0
        # each layout's ring sends what its exchange plan says (the Ulysses part: local lengths differ by a few
        # tokens at most), within 1.10 x 3 x the k/v rows other ranks' tiles read
        for case in (old, new):
            assert case["bytes_ratio"] == pytest.approx(1.0, abs=0.05), (backend, case["layout"])
            assert case["bytes_per_rank"] <= 1.10 * case["bytes_read"], (backend, case["layout"])


def test_bench_counts_collectives_and_host_reads_per_step(causal_two):
    """One forward+backward on 2 ranks: the ring exchanges k/v N-1 times forward, k/v and dk/dv N-1 times each
    backward; Ulysses makes four all-to-alls each way. Host reads are counted too (tools/host_reads.py; that
    a training step has none is tests/multiproc/test_host_reads.py's)."""
    cases = _cases(causal_two)
    assert cases["p2p"]["collectives_per_step"] == 3 * (2 - 1)
    assert cases["all2all"]["collectives_per_step"] == 8
    for case in causal_two["cases"]:
        assert isinstance(case["host_reads_per_step"], int) and case["host_reads_per_step"] >= 0
