"""pcp-bench (paddle_cp/tools/bench.py) run for real on CPU ranks, and the planner checked against what it measures."""
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paddle_cp import planner
from paddle_cp.config import load_config
from paddle_cp.tools import bench, plan

ROOT = Path(__file__).resolve().parents[1]
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


def test_work_per_rank():
    for n in (2, 3, 4):
        assert len(set(bench.work_per_rank("p2p", n, 8 * n, 4, causal=True))) == 1
    assert sum(bench.work_per_rank("p2p", 4, 64, 2, causal=True)) == 2 * 64 * 65 // 2
    assert bench.work_per_rank("all2all", 2, 16, 3, causal=False) == [2 * 256, 256]  # uneven head split


def test_bench_refuses_bad_shapes():
    with pytest.raises(SystemExit):
        bench.parse_args(["--nproc", "4", "--seq", "100"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--nproc", "3", "--seq", "96", "--heads", "8", "--backend", "all2all"])


def test_planner_traffic_formulas():
    b, s, h, hk, d, e = 1, 1024, 8, 2, 64, 2
    kv = 2 * b * (s // 4) * hk * d * e
    assert planner.attention_bytes("p2p", b, s, h, hk, d, 4, e) == 10 * kv
    assert planner.attention_min_bytes("p2p", b, s, h, hk, d, 4, e) == 9 * kv
    # Ulysses over 4 ranks with 2 k/v heads sends them repeated to 4
    assert planner.attention_bytes("all2all", b, s, h, hk, d, 4, e) == 2 * 3 * (b * s // 4 * d * e) * (2 * h + 8) // 4
    uly, ring = planner.attention_traffic(b, s, h, hk, d, ring=2, ulysses=2, elem=e)
    assert uly == planner.ulysses_bytes(b, s // 2, h, hk, d, 2, e)
    assert ring == planner.ring_bytes(b, s, 1, d, 2, e)


def test_model_shape_counts_llama_parameters():
    llama2_7b = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                 "vocab_size": 32000, "intermediate_size": 11008}
    assert planner.ModelShape.from_config(llama2_7b).params == 6_738_415_616


def test_plan_cp_cli(tmp_path, capsys):
    config = {"num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
              "vocab_size": 32000, "intermediate_size": 2816}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "plan.json"
    plan.main(["--config", str(tmp_path / "config.json"), "--seq", "131072", "--devices", "8",
                           "--memory-gb", "24", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "best layout" in printed and "cp_config:" in printed
    result = json.loads(out.read_text())
    fitting = [e["tokens_per_second"] for e in result["estimates"] if e["fits"]]
    assert fitting == sorted(fitting, reverse=True)
    assert result["best"]["fits"]
    assert result["best"]["layout"]["ring"] * result["best"]["layout"]["ulysses"] > 1  # dp alone does not fit
    mesh, _ = load_config(result["config"], world_size=8)
    assert math.prod(mesh.shape) == 8


def test_context_parallel_divides_attention_memory():
    model = planner.ModelShape(layers=4, hidden=512, heads=8, kv_heads=8, vocab=1000, intermediate=1024)
    one = planner.memory(model, planner.Layout(1, 1, 1, 1), 8192, 1, 2)["activations"]
    four = planner.memory(model, planner.Layout(1, 4, 1, 1), 8192, 1, 2)["activations"]
    assert four == pytest.approx(one / 4)


def test_console_scripts_name_the_tools_mains():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    resolved = {name: getattr(importlib.import_module(target.split(":")[0]), target.split(":")[1])
                for name, target in scripts.items()}
    assert resolved == {"pcp-bench": bench.main, "pcp-plan": plan.main}
