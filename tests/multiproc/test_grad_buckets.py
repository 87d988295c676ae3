"""Gradient buckets reduced during backward (data_parallel/buckets.py) on 4 gloo ranks vs one card: one launch
of tests/workers/grad_buckets.py (an MLP on dp4, its allocator peaks first; a branch one rank takes under sep; a
PaddleFormers Llama on six layouts)."""
import importlib.util

import pytest
from launcher import launch_once

TOLERANCE = 1e-5
LAYOUTS = ["dp2xmp2_l0", "dp2xmp2_l2", "dp2xmp2_l3", "sep2xdp2_l1", "sep2xdp2_l2"]
# the worker's groups, in this order, one launch: the MLP's, then the Llama's where PaddleFormers is installed
GROUPS = ("mlp",) + (("llama",) if importlib.util.find_spec("paddleformers") else ())


def _reports():
    reports = launch_once("grad_buckets.py", 4, *GROUPS)
    for report in reports:
        assert "crash" not in report["values"], report["values"]["crash"]
    return reports


@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("paddleformers")
    return _reports()


@pytest.fixture(scope="module")
def mlp():
    return _reports()


def _worst(report, prefix):
    diffs = {k: v for k, v in report["max_abs"].items() if k.startswith(prefix + ".")}
    assert diffs, f"no measurements for {prefix}"
    return max(diffs.items(), key=lambda item: item[1])


@pytest.mark.parametrize("run", LAYOUTS + ["pp2xdp2_l0"])
def test_bucketed_training_matches_one_card(llama, run):
    """5 steps of 2 accumulated micro-batches, buckets of 0.02 MiB (10-13 of them): losses and parameters
    within 1e-5 of one card."""
    for report in llama:
        worst, error = _worst(report, run)
        assert error < TOLERANCE, (worst, error)


@pytest.mark.parametrize("run", LAYOUTS)
def test_buckets_are_reduced_during_the_last_backward_in_one_order(llama, run):
    """Steps 3-5: every bucket is issued during the step's second backward (its last), in index order, the
    same on every rank; all but the one holding the first-used parameters (the embedding's gradient comes
    last) before backward's last gradient arrived."""
    issued = [report["values"][f"{run}.issued"] for report in llama]
    assert all(steps == issued[0] for steps in issued)
    buckets = llama[0]["values"][f"{run}.buckets"]
    assert buckets >= 10 and llama[0]["values"][f"{run}.early_buckets"] == buckets
    for step in issued[0]:
        assert step["passes"] == 2
        order = [index for index, _, _ in step["issued"]]
        assert order == list(range(buckets))
        assert all(backward_pass == 2 for _, _, backward_pass in step["issued"])
        positions = [position for _, position, _ in step["issued"]]
        assert positions == sorted(positions) and step["arrivals"] // 2 < positions[0]
        assert sum(position < step["arrivals"] for position in positions) >= buckets - 1


@pytest.mark.parametrize("run", LAYOUTS + ["pp2xdp2_l0"])
def test_no_host_reads_in_data_parallel_in_steady_state(llama, run):
    """Steps 3-5 (forward, backwards, step, clear_grad): no Tensor value read on the host and no to_tensor
    from code in paddle_cp/data_parallel, but under a pipeline, whose loss-factor agreement
    (pipeline/loss_factor.py, called by step) reads the factors gathered the step before: one deferred read
    per step, which waits for nothing issued this step (tests/multiproc/test_host_reads.py tells them apart)."""
    for report in llama:
        reads = report["values"][f"{run}.host_reads"].get("data_parallel", 0)
        assert reads == (3 if run.startswith("pp") else 0), reads


def test_pipeline_buckets_wait_for_step(llama):
    """The factor a script puts on a pipeline step's loss comes after the schedule's backwards: nothing is
    reduced during them."""
    for report in llama:
        assert all(step["issued"] == [] for step in report["values"]["pp2xdp2_l0.issued"])


def test_level2_holds_a_share_of_the_gradients(mlp):
    """dp4, one backward per step, 16 Linear layers in 0.04 MiB buckets: level 2 holds at most a quarter of
    the gradients plus one bucket at its peak (counted), level 1 all of them; the host allocator's peak over
    backward and the reduction drops by at least half the gradients' bytes."""
    for report in mlp:
        values = report["values"]
        grads = values["alloc_l1.grads"]
        assert values["alloc_l1.grad_peak"] == grads
        largest = grads / values["alloc_l2.buckets"] * 2  # buckets are about equal: two make room
        assert values["alloc_l2.grad_peak"] <= grads / 4 + largest, (values["alloc_l2.grad_peak"], grads)
        assert values["alloc_l2.peak"] <= values["alloc_l1.peak"] - grads / 2, (values["alloc_l2.peak"],
                                                                                   values["alloc_l1.peak"])
        for level in (1, 2):  # each bucket issued during backward
            positions = [position for _, position, _ in values[f"alloc_l{level}.issued"]]
            assert len(positions) == values[f"alloc_l{level}.buckets"]
            assert all(position < values[f"alloc_l{level}.arrivals"] for position in positions[:-1])


@pytest.mark.parametrize("run", ["passes_change_l0", "passes_change_l2", "branch_l0", "branch_l2"])
def test_changing_backward_counts_and_branches_match_one_card(mlp, run):
    """Backwards per step 1, 1, 2, 1, 3 (the third and fifth steps have more than learned: a second round
    reduces what came after the first); a layer only rank 0 uses from step 3 on (zeros elsewhere, no host
    read) and one no rank uses until step 4 (its bucket agrees presence each step and stays in step())."""
    for report in mlp:
        worst, error = _worst(report, run)
        assert error < TOLERANCE, (worst, error)
        issued = report["values"][f"{run}.issued"]
        assert issued[0] == 0 and sum(issued) > 0, issued  # the first step learns
    # the extra layers are in one bucket: agreed each step until both were used (step 4), then zeros
    dead = [report["values"][f"{run}.dead_buckets"] for report in mlp]
    assert all(d == ([1, 1, 1, 0, 0] if run.startswith("branch") else [0] * 5) for d in dead), dead


def test_a_branch_only_one_rank_takes_under_sep_is_reduced_in_step(mlp):
    """sep over the 4 ranks: a branch only rank 0 runs (its tokens hold the mark) has a gradient there only,
    arriving before the attention's backward exchanges. Agreed uneven at the first step, its buckets are reduced
    in step(), the others' during backward (reduced there too, it held rank 0 in the all-reduce while the others
    waited for it in the ring, until the watchdog's timeout); 4 AdamW steps equal one card."""
    issued = [report["values"]["branch_sep.issued"] for report in mlp]
    assert all(steps == issued[0] for steps in issued), issued
    for report in mlp:
        worst, error = _worst(report, "branch_sep")
        assert error < TOLERANCE, (worst, error)
        values = report["values"]
        assert values["branch_sep.uneven"] == [["branch.bias"], ["branch.weight"]], values["branch_sep.uneven"]
        steps = values["branch_sep.issued"]
        assert steps[0] == [] and all(step == steps[1] for step in steps[1:]), steps  # the first step learns
        assert len(steps[1]) == values["branch_sep.buckets"] - 2, steps
