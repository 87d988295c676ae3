"""Multi-rank context parallelism on CPU gloo ranks vs a single-process reference (fp32, 1e-5)."""
from typing import NamedTuple

import pytest
from launcher import launch, launch_once

TOL = 1e-5
WORLDS = [1, 2, 3, 4]


class ErrorCase(NamedTuple):
    check: str          # the name the worker records it under
    message: str        # what the ValueError must name
    min_world: int = 1  # needs peers to go wrong
    only_world: int = 0  # checked at this world size alone (0: every size from min_world)


ERRORS = [
    ErrorCase("unknown_backend", "use one of"),
    ErrorCase("context_backend", "use one of"),
    ErrorCase("hybrid_without_degree", "needs ulysses_degree"),
    ErrorCase("degree_without_hybrid", "takes none"),
    ErrorCase("unknown_rotation", "use one of ['planned', 'allgather']"),
    ErrorCase("mesh_without_sep", "dim_names"),
    ErrorCase("dropout", "dropout to 0"),
    ErrorCase("shapes", "shapes disagree"),
    ErrorCase("mask_shape", "this rank's query rows against all keys"),
    ErrorCase("mismatched_plans", "same backend and ulysses_degree"),
    ErrorCase("short_sequence", "every rank needs at least one token", min_world=2),
    ErrorCase("ulysses_heads", "use ulysses_degree <=", min_world=2),
    ErrorCase("wrong_seq_len", "pass seq_len=", min_world=2),
    ErrorCase("degree_not_dividing", "positive divisor", only_world=4),
    ErrorCase("shards_not_layout", "shard with PrepareContextParallel or paddle_cp.shard_sequence", min_world=2),
    ErrorCase("unshard_wrong_seq_len", "pass the seq_len and backend the tensor was sharded with", min_world=2),
    ErrorCase("bypassed_attention", "without paddle_cp computing its attention"),
]


def _checked_at(case, world):
    return world == case.only_world if case.only_world else world >= case.min_world


def attention_reports(world):
    """One launch per world size serves every test below."""
    return launch_once("attention_parity.py", world)


def assert_close(reports):
    for report in reports:
        assert not report["values"].get("crash"), report["values"]["crash"]
        assert report["max_abs"], "the worker compared nothing"
        worst = {name: err for name, err in report["max_abs"].items() if not err <= TOL}
        assert not worst, f"rank {report['rank']} beyond {TOL}: {worst}"


@pytest.mark.parametrize("world", WORLDS)
def test_attention_matches_single_process(world):
    reports = attention_reports(world)
    assert_close(reports)
    hybrid = world == 4
    for report in reports:
        # functional cases x (out, dq, dk, dv); per backend: window+sinks+MLA x (out, dq, dk, dv, dsinks),
        # layer plans (plain, docs, dense), unshard and the output without seq_len; a branch only rank 0 takes;
        # the recompute cases x (none, reentrant, plain, refetch) x (out, dq, dk, dv)
        cases = 12 + 3 * hybrid
        assert len(report["max_abs"]) == 4 * cases + (5 + 3 + 1 + 1) * (2 + hybrid) + 1 + 16 * (3 + hybrid)
        if world > 1:
            assert report["values"]["bytes"]["ring"] > 0 and report["values"]["bytes"]["ulysses"] > 0


@pytest.mark.parametrize("world", WORLDS)
def test_attention_skips_masked_work_and_stays_balanced(world):
    reports = attention_reports(world)
    packed = [r["values"]["packed.work"] for r in reports]
    causal = [r["values"]["causal.work"] for r in reports]
    skipped = sum(w["skipped"] for w in packed) / sum(w["computed"] + w["skipped"] for w in packed)
    # packed documents skip more than causality alone, and never more than the masked pairs
    assert sum(w["skipped"] for w in causal) < sum(w["skipped"] for w in packed)
    assert skipped <= reports[0]["values"]["packed.masked_fraction"]
    # balanced: every rank computes the same causal work, up to tiles that straddle a chunk edge
    computed = [w["computed"] for w in causal]
    assert max(computed) / min(computed) < 1.05


@pytest.mark.parametrize("world", WORLDS)
def test_sliding_window_work_is_seq_times_window_over_ranks(world):
    """Each rank's queries meet about window + one tile of keys (tiles of max(window, 32) rows)."""
    reports = attention_reports(world)
    seq, window = reports[0]["values"]["window.seq_window"]
    for report in reports:
        work, causal_work = report["values"]["window.work"], report["values"]["window.causal_work"]
        assert work["computed"] <= -(-seq // world) * (window + 2 * 32)
        assert work["computed"] < causal_work["computed"]


@pytest.mark.parametrize("world", WORLDS)
def test_planned_exchange_sends_only_the_rows_read(world):
    """rotate='planned' (the default) on p2p and hybrid, every mask, the documents layout, windows and padding:
    allgather's output and gradients (whole blocks; the sums in another order) and exactly the ring bytes
    exchange_plan counts, in all at most 1.10 x 3 x the k/v rows read; on packed documents kept whole, a
    fraction of whole blocks' bytes."""
    reports = attention_reports(world)
    names = {name for name in reports[0]["values"] if name.startswith("planned.")}
    # the ring's functional cases, a window, padding; packed documents past one rank; hybrid's six at 4 ranks
    assert len(names) == 10 + (world > 1) + 6 * (world == 4)
    for name in names:
        runs = [report["values"][name] for report in reports]
        for run in runs:
            assert run["max_rel_diff"] <= 1e-5, (name, run)
            assert run["compared"] >= 4
            assert run["planned_bytes"] == run["planned"], (name, run)
        assert sum(r["planned_bytes"] for r in runs) <= 1.10 * sum(r["read"] for r in runs), name
    if world > 1:
        packed = next(name for name in names if name.startswith("planned.packed.p2p"))
        runs = [report["values"][packed] for report in reports]
        assert sum(r["planned_bytes"] for r in runs) < 0.7 * sum(r["whole_block_bytes"] for r in runs)


@pytest.mark.parametrize("world", WORLDS)
def test_recomputed_ring_backward_reads_the_replays_rows(world):
    """Under fleet.utils.recompute (reentrant and not) the ring's backward reads the k/v its replay received: each
    rank sends what the call without recomputation sends (planned: the exchange plan's 3 x rows read, not 4 x)
    in as many ring calls (planned: 3 x N-1 shifts), bit for bit the same output and gradients (within 1e-5 of
    one process: test_attention_matches_single_process). Past the limit a replay holds, the backward fetches
    them again: 4/3 of those bytes and calls, the same results."""
    reports = attention_reports(world)
    names = {name for name in reports[0]["values"] if name.startswith("recompute.")}
    assert len(names) == 3 + (world == 4)
    for name in names:
        for report in reports:
            case = report["values"][name]
            sent, ring = case["sent"], case["ring"]
            assert set(sent) == {"none", "reentrant", "plain", "refetch"}
            assert all(case["bitwise"].values()), (name, case)
            for mode in ("reentrant", "plain"):
                assert sent[mode] == sent["none"], (name, mode, case)
            assert 3 * sent["refetch"]["calls"] == 4 * sent["none"]["calls"], (name, case)
            if case["rotate"] == "planned":  # a third pass of the rows others read from this rank (k/v, fp32 as the grads)
                assert sent["refetch"]["bytes"] == sent["none"]["bytes"] + case["read"] // 3, (name, case)
            else:  # whole blocks, as many bytes each pass
                assert 3 * sent["refetch"]["bytes"] == 4 * sent["none"]["bytes"], (name, case)
            if case["rotate"] == "planned":
                assert sent["none"]["bytes"] == case["planned"], (name, case)
                assert sent["none"]["calls"] == 3 * (ring - 1), (name, case)
            if ring > 1:
                assert sent["none"]["bytes"] > 0, (name, case)


@pytest.mark.parametrize("world", WORLDS)
def test_worker_checked_exactly_the_expected_errors(world):
    expected = {case.check for case in ERRORS if _checked_at(case, world)}
    for report in attention_reports(world):
        assert set(report["errors"]) == expected


@pytest.mark.parametrize("world,case", [pytest.param(world, case, id=f"{case.check}-{world}")
                                        for world in WORLDS for case in ERRORS if _checked_at(case, world)])
def test_error_names_the_fix_on_every_rank(world, case):
    for report in attention_reports(world):
        kind, message = report["errors"][case.check]
        assert kind == "ValueError", (case.check, kind, message)
        assert case.message in message, (case.check, message)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shards_not_forming_the_layout_fail_alike_on_every_rank(world):
    """The functional attention without seq_len agrees on the lengths first: no rank waits on another."""
    assert len({tuple(r["errors"]["shards_not_layout"]) for r in attention_reports(world)}) == 1


@pytest.mark.parametrize("world", [2, 3, 4])
def test_llama_training_matches_single_process(world):
    sources = ["tiny"]
    try:
        import paddleformers  # noqa: F401

        sources.append("paddleformers")
    except ImportError:
        pass
    reports = launch("model_parity.py", world, *sources)
    assert_close(reports)
    for run in reports[0]["values"]["runs"]:
        assert {f"{run}.{kind}" for kind in ("loss", "grad", "param")} <= set(reports[0]["max_abs"])
        losses = reports[0]["values"][f"{run}.losses"]
        assert losses[-1] < losses[0], "training should reduce the loss"
