"""The bench's and planner's single-process pieces: work per rank, argument checks, formulas, the CLI."""
import importlib
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from paddle_cp.api.config import load_config
from paddle_cp.cost import attention as attention_cost
from paddle_cp.tools.bench import attention_figures
from paddle_cp.tools.bench import cli as bench
from paddle_cp.tools.bench import pp as bench_pp
from paddle_cp.tools.memory import cli as memory
from paddle_cp.tools.plan import cli as plan
from paddle_cp.tools.elastic import cli as elastic
from paddle_cp.tools.selftest import cli as selftest
from paddle_cp.integrations.paddleformers import cli
from paddle_cp.cost.memory import memory as memory_estimate
from paddle_cp.cost.model_shape import ModelShape
from paddle_cp.cost.candidate import Layout

ROOT = Path(__file__).resolve().parents[2]


def test_work_per_rank():
    for n in (2, 3, 4):
        assert len(set(attention_figures.work_per_rank("p2p", n, 8 * n, 4, causal=True))) == 1
    assert sum(attention_figures.work_per_rank("p2p", 4, 64, 2, causal=True)) == 2 * 64 * 65 // 2
    assert attention_figures.work_per_rank("all2all", 2, 16, 3, causal=False) == [2 * 256, 256]  # uneven head split
    hybrid = attention_figures.work_per_rank("hybrid", 4, 64, 4, causal=True, ulysses_degree=2)
    assert len(set(hybrid)) == 1 and sum(hybrid) == 4 * 64 * 65 // 2


class BenchArgs(NamedTuple):
    name: str
    argv: list


BAD_BENCH_ARGS = [
    BenchArgs("seq_shorter_than_ranks", ["--nproc", "4", "--seq", "3"]),
    BenchArgs("fewer_heads_than_ulysses_ranks", ["--nproc", "4", "--heads", "3", "--kv-heads", "1",
                                                 "--backend", "all2all"]),
    BenchArgs("degree_not_dividing_ranks", ["--nproc", "4", "--backend", "hybrid", "--ulysses-degree", "3"]),
    BenchArgs("gqa_heads_not_a_multiple", ["--nproc", "2", "--heads", "6", "--kv-heads", "4"]),
    BenchArgs("unknown_document_lengths", ["--nproc", "2", "--documents", "no-such-distribution"]),
    BenchArgs("negative_document_batch", ["--nproc", "2", "--documents", "lognormal", "--doc-batch", "-1"]),
]


@pytest.mark.parametrize("case", BAD_BENCH_ARGS, ids=lambda case: case.name)
def test_bench_refuses_bad_shapes(case):
    with pytest.raises(SystemExit):
        bench.parse_args(case.argv)


def test_bench_takes_any_length_and_head_count_the_library_runs():
    """No stale limits: lengths and head counts that do not divide are fine."""
    for argv in (["--nproc", "4", "--seq", "100"], ["--nproc", "3", "--seq", "97", "--heads", "8", "--backend", "all2all"],
                 ["--nproc", "4", "--seq", "30", "--heads", "3", "--kv-heads", "1", "--backend", "hybrid"]):
        assert bench.parse_args(argv).nproc == int(argv[1])


def test_planner_traffic_formulas():
    b, s, h, hk, d, e = 1, 1024, 8, 2, 64, 2
    kv = 2 * b * (s // 4) * hk * d * e
    assert attention_cost.attention_bytes("p2p", b, s, h, hk, d, 4, e) == 9 * kv  # 3(N-1) hops of k/v
    # Ulysses over 4 ranks with 2 k/v heads sends them repeated to 4
    assert attention_cost.attention_bytes("all2all", b, s, h, hk, d, 4, e) == 2 * 3 * (b * s // 4 * d * e) * (2 * h + 8) // 4
    uly, ring = attention_cost.attention_traffic(b, s, h, hk, d, ring=2, ulysses=2, elem=e)
    assert uly == attention_cost.ulysses_bytes(b, s // 2, h, hk, d, 2, e)
    assert ring == attention_cost.ring_bytes(b, s, 1, d, 2, e)
    assert attention_cost.attention_bytes("hybrid", b, s, h, hk, d, 4, e, ulysses_degree=2) == uly + ring


def test_planner_repeats_kv_heads_as_ulysses_does():
    from paddle_cp.attention.algorithms.ulysses import head_split

    for heads, kv_heads in ((8, 8), (8, 2), (6, 3), (8, 1), (12, 4)):
        for ulysses in range(1, heads + 1):
            assert attention_cost.kv_heads_sent(heads, kv_heads, ulysses) == sum(
                head_split(heads, kv_heads, ulysses).kv_counts), (heads, kv_heads, ulysses)


def test_planner_hybrid_holds_ulysses_copies_over_its_group_only():
    """kv_heads=1 is repeated to U=2 for hybrid, to 4 for all2all over 4 ranks."""
    b, s, h, hk, d = 1, 1024, 8, 1, 64
    tokens = b * s // 4
    hybrid = attention_cost.attention_held_bytes("hybrid", b, s, h, hk, d, 4, ulysses_degree=2)
    all2all = attention_cost.attention_held_bytes("all2all", b, s, h, hk, d, 4)
    assert all2all - hybrid == tokens * 2 * (4 - 2) * d * attention_cost.FP32
    model = ModelShape(layers=2, hidden=512, heads=8, kv_heads=1, vocab=1000, intermediate=1024)
    by_layout = {name: memory_estimate(model, Layout(1, ring, uly, 1), s, 1, 4)["activations"]
                 for name, ring, uly in (("hybrid", 2, 2), ("all2all", 1, 4))}
    assert by_layout["all2all"] - by_layout["hybrid"] == 2 * (all2all - hybrid)


def test_model_shape_counts_llama_parameters():
    llama2_7b = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                 "vocab_size": 32000, "intermediate_size": 11008}
    assert ModelShape.from_config(llama2_7b).params == 6_738_415_616


def test_plan_cp_cli(tmp_path, capsys):
    config = {"num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
              "vocab_size": 32000, "intermediate_size": 2816}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "plan.json"
    plan.main(["--config", str(tmp_path / "config.json"), "--seq", "131072", "--devices", "8",
                           "--memory-gb", "24", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "resembles" in printed and "cp_config:" in printed
    result = json.loads(out.read_text())
    fitting = [e["tokens_per_second"] for e in result["estimates"] if e["fits"]]
    assert fitting == sorted(fitting, reverse=True)
    assert result["best"]["fits"]
    assert result["best"]["layout"]["ring"] * result["best"]["layout"]["ulysses"] > 1  # dp alone does not fit
    mesh, _ = load_config(result["config"], world_size=8)
    assert math.prod(mesh.shape) == 8


def test_context_parallel_divides_attention_memory():
    model = ModelShape(layers=4, hidden=512, heads=8, kv_heads=8, vocab=1000, intermediate=1024)
    one = memory_estimate(model, Layout(1, 1, 1, 1), 8192, 1, 2)["activations"]
    four = memory_estimate(model, Layout(1, 4, 1, 1), 8192, 1, 2)["activations"]
    assert four == pytest.approx(one / 4)


def test_console_scripts_name_the_tools_mains():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    resolved = {name: getattr(importlib.import_module(target.split(":")[0]), target.split(":")[1])
                for name, target in scripts.items()}
    assert resolved == {"pcp-bench": bench.main, "pcp-plan": plan.main, "pcp-memory": memory.main,
                        "pcp-bench-pp": bench_pp.main, "pcp-selftest": selftest.main, "pcp-train": cli.main,
                        "pcp-launch": elastic.main}


@pytest.mark.parametrize("tool, name, modes", [(bench, "pcp-bench", ["--pool", "--planning", "--vision",
                                                                         "--mixer gated_deltanet", "--saves"]),
                                               (memory, "pcp-memory", ["--phases", "--experts", "--sharding"])])
def test_help_names_the_tool_its_defaults_and_its_other_modes(capsys, tool, name, modes):
    """A newcomer's `--help` finds every mode the docs use (each parsed by its own tool) and each default."""
    with pytest.raises(SystemExit):
        tool.parse_args(["--help"])
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {name} ") and "(default: " in text, text
    assert all(f"  {mode} " in text for mode in modes), text


def test_memory_bench_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        memory.parse_args(["--nproc", "4", "--seq", "6"])  # shorter than 2 x N
    with pytest.raises(SystemExit):
        memory.parse_args(["--granularity", "0"])


def test_memory_phases_table_and_arguments():
    """pcp-memory --phases: its own arguments, one row per rank and phase (initialize first)."""
    from paddle_cp.tools.memory import phases as memory_phases

    args = memory_phases.parse_args(["--phases", "--layout", "pp2xsep2", "--init", "lazy"])
    assert (args.layout, args.init, args.family) == ("pp2xsep2", "lazy", "llama")
    with pytest.raises(SystemExit):
        memory_phases.parse_args(["--phases", "--layout", "dp8"])
    mib = 2 ** 20
    rows = [dict(rank=r, phase=p, peak=3 * mib, share=2 * mib, bound=4 * mib, read=mib, written=0, seconds=0.5)
            for p in ("load", "initialize") for r in (1, 0)]
    lines = memory_phases.table(rows).splitlines()
    assert lines[0].split()[:3] == ["rank", "phase", "peak"] and len(lines) == 2 + 4
    assert [line.split()[:2] for line in lines[2:]] == [["0", "initialize"], ["1", "initialize"], ["0", "load"],
                                                        ["1", "load"]]
    assert lines[2].split()[2:4] == ["3.00", "2.00"]


def test_memory_sharding_cases_table_and_arguments():
    """pcp-memory --sharding: level 0 first on each mesh (what the others are measured against), then each level
    over dp x sep and over dp; traffic sorted by purpose; one row per case."""
    from paddle_cp.tools.memory import sharding as memory_sharding

    args = memory_sharding.parse_args(["--sharding", "--meshes", "sep4", "--levels", "2", "3"])
    assert memory_sharding.cases(args) == [("sep4", "-", 0), ("sep4", "dp x sep", 2), ("sep4", "dp", 2),
                                           ("sep4", "dp x sep", 3), ("sep4", "dp", 3)]
    with pytest.raises(SystemExit):
        memory_sharding.parse_args(["--sharding", "--levels", "0"])
    assert [memory_sharding.purpose(t) for t in ("grad_reduce_scatter", "param_fetch", "ring", "pp_recv")] == [
        "gradients", "parameters", "attention", "other"]
    rank = dict.fromkeys(memory_sharding.FIELDS, 2 ** 20)
    results = memory_sharding.with_ratios([
        {"mesh": "sep4", "sharded_over": over, "level": level, "largest_parameter": 1024,
         "ranks": [dict(rank, params=2 ** 20 // share, adam=2 ** 21 // share)] * 4}
        for over, level, share in (("-", 0, 1), ("dp x sep", 3, 4))])
    assert [(r["params_ratio"], r["adam_ratio"]) for r in results] == [(1.0, 1.0), (0.25, 0.25)]
    lines = memory_sharding.table(results).splitlines()
    assert len(lines) == 2 + len(results) + 1 and "0.250" in lines[3]


def test_bench_documents_model_only_prices_the_layouts_side_by_side(tmp_path, capsys):
    """pcp-bench --documents --model-only: no ranks; per backend the chosen layout, 2N chunks and whole
    documents, the chosen never slower than the chunks (within the 1% tie rule), tokens within the bound,
    at most one kernel call per ring step; a file of lengths works as the named distributions do."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("600\n90\n2500\n31\n1200\n7000\n")
    for source in ("lognormal", str(lengths)):
        out = tmp_path / "model.json"
        bench.main(["--documents", source, "--model-only", "--nproc", "4", "--seq", "16384",
                    "--backend", "p2p", "hybrid", "--json", str(out)])
        assert "no GPU ran" in capsys.readouterr().out
        rows = json.loads(out.read_text())["gpu_model"]
        assert [(r["backend"], r["layout"]) for r in rows] == [
            (b, name) for b in ("p2p", "hybrid") for name in ("chosen", "chunks", "whole", "tiles", "across")]
        for backend in ("p2p", "hybrid"):
            by = {r["layout"]: r for r in rows if r["backend"] == backend}
            assert by["chosen"]["slowest_ms"] <= 1.01 * by["chunks"]["slowest_ms"]
            assert by["chunks"]["tokens_max"] == 16384 // 4 and by["chosen"]["memory_bound_ok"]
            assert all(1 <= r["kernel_calls_per_pass"] <= r["ring"] and r["planning_ms"] > 0 for r in by.values())
            # the link-priced choices' predicted steps (tiles and exchange) within a node and across
            assert by["chosen"]["step_within_ms"] <= 1.01 * by["tiles"]["step_within_ms"]  # the 1% tie rule
            assert by["across"]["step_across_ms"] <= 1.01 * min(by["tiles"]["step_across_ms"],
                                                                by["chunks"]["step_across_ms"])
    with pytest.raises(SystemExit):
        bench.main(["--model-only", "--nproc", "4"])


@pytest.mark.parametrize("program, name", [("/venv/bin/pcp-selftest", "pcp-selftest"),
                                           ("/repo/paddle_cp/tools/selftest/cli.py", "pcp-selftest"),
                                           ("/repo/paddle_cp/tools/bench/cli.py", "pcp-bench"),
                                           ("/repo/paddle_cp/tools/bench/pp.py", "pcp-bench-pp")])
def test_progress_lines_carry_the_tools_name(monkeypatch, capsys, program, name):
    monkeypatch.setattr(sys, "argv", [program])
    bench.progress("seq 2048")
    assert capsys.readouterr().err == f"[{name}] seq 2048\n"
    monkeypatch.setattr(sys, "argv", ["/venv/bin/pytest"])  # launch() from a test: named by the script it launches
    bench.progress("launching 4 CPU ranks", program)
    assert capsys.readouterr().err == f"[{name}] launching 4 CPU ranks\n"


def test_bench_lengths_take_k_suffixes():
    assert bench.parse_args(["--seq", "2K", "4096"]).seq == [2048, 4096]


def test_bench_documents_counts_the_bytes_each_layout_exchanges(tmp_path, capsys):
    """pcp-bench --documents prints per layout the bytes whole blocks take, the exchange plan's and the bytes
    read (computed): one causal document reads 3/4 of the whole blocks; of 100-token documents, those kept
    whole read nothing and 2N chunks only the tile before each chunk edge a document crosses."""
    lengths = tmp_path / "short.txt"
    lengths.write_text("100\n")
    row_bytes = 2 * 64 * 4  # one k/v head of 64, fp32
    for source in ("single", str(lengths)):
        out = tmp_path / "model.json"
        bench.main(["--documents", source, "--model-only", "--nproc", "8", "--seq", "16384", "--backend", "p2p",
                    "--heads", "8", "--kv-heads", "1", "--head-dim", "64", "--json", str(out)])
        assert "computed from the layout, not measured" in capsys.readouterr().out
        by = {r["layout"]: r for r in json.loads(out.read_text())["gpu_model"]}
        # 7 blocks, 3 times
        assert all(r["whole_blocks_mib"] * 2 ** 20 == 3 * 7 * 2048 * row_bytes for r in by.values())
        assert all(r["planned_mib"] == r["read_mib"] for r in by.values())
        if source == "single":  # in 2N chunks (the choice across nodes, one rank a node, keeps it contiguous)
            assert all(by[name]["read_mib"] == 0.75 * by[name]["whole_blocks_mib"]
                       for name in ("chosen", "chunks", "whole"))
    assert by["whole"]["read_mib"] == 0
    # 15 chunk edges cut a document; 14 lie between two ranks (chunks 7 and 8 are one rank's)
    assert by["chunks"]["read_mib"] * 2 ** 20 == 3 * 14 * 128 * row_bytes / 8


def test_saves_bench_ratios_and_arguments():
    """pcp-bench --saves: each variant's slowest rank against the plain loop's, wall and CPU time apart; the copy's
    host bytes, the largest rank's."""
    from paddle_cp.tools.bench import saves

    with pytest.raises(SystemExit):
        saves.parse_args(["--steps", "1"])
    args = saves.parse_args(["--steps", "4", "--rounds", "2"])
    walls, cpus = [1.0, 1.01, 1.02, 1.2], [0.8, 0.8, 0.82, 0.84]
    measured = {"ranks": [[*walls, *cpus, 100.0, 120.0], [w / 2 for w in walls] + [c / 2 for c in cpus] + [50.0, 9.0]]}
    result = saves.summarise(args, measured)
    assert [row["variant"] for row in result["rows"]] == list(saves.VARIANTS)
    assert [round(row["ratio"], 3) for row in result["rows"]] == [1.0, 1.01, 1.02, 1.2]
    assert [round(row["cpu_ratio"], 3) for row in result["rows"]] == [1.0, 1.0, 1.025, 1.05]
    assert (result["copy_bytes"], result["held_bytes"]) == (100.0, 120.0)
    assert "async save every k" in saves.table(result) and "the least of 2 rounds" in saves.table(result)
