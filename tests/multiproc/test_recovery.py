"""Recovery without a person, under Paddle's own elastic launch (pcp-launch) against a real etcd server of the
test's own: ranks killed with SIGKILL during a forward, a backward and an async save (one job, three restarts),
a SIGTERM to one rank (every rank saves and stops; the next launch resumes), a step that fails every time (the
job stops with one message), a node lost (the job goes on with the ranks left). Every run is
tests/workers/recovery_run.py; the attempt that finishes also trains the same job uninterrupted in the same
processes, and the losses must be equal bit for bit (fp32, the same ranks), or within 1e-5 of one card's where a
restart left one rank.

The kills are deterministic: the steps come from a seeded generator (printed), each fault fires once (a marker
file in the job's folder records the attempt it hit) and a rank kills itself at its step and phase.
"""
import json
import random
import re

import pytest
from launcher import etcd_server, launch, launch_elastic

pytest.importorskip("paddleformers")

STEPS, SAVE_EVERY = 10, 2


def _history(root):
    """[(attempt, resumed after step)] and the attempts that stopped the job, from the job's attempt history."""
    starts, stopped = [], []
    for line in (root / "pcp_recovery" / "attempts.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry.get("stopped"):
            stopped.append(entry["attempt"])
        else:
            starts.append((entry["attempt"], entry["resumed_step"]))
    return starts, stopped


def _lost_to_signals(output):
    """Restarts of ranks Paddle 3.3.1's CPU build lost to SIGABRT/SIGSEGV (tools/launcher.py): not ours."""
    return len(re.findall(r"code (-6|-11)\b", output))


def _committed_before(step):
    """The newest checkpoint committed when step `step` runs: an async save made after step n is written during
    step n + 1, agreed written at the boundary after it and published at the next (the agreement is read a step
    late): at the boundary after step n + 2. With a save every 2 steps that is also where the next save publishes
    it in any case (a save first finishes the one pending): no timing decides it."""
    return max(0, (step - 3) // SAVE_EVERY * SAVE_EVERY)


def test_killed_ranks_restart_by_themselves_and_the_losses_equal_an_uninterrupted_run(tmp_path):
    rng = random.Random(49)
    forward = rng.choice([2, 3])
    backward = rng.choice([forward + 2, forward + 3])
    save = rng.choice([step for step in range(backward + 2, STEPS) if step % SAVE_EVERY == 0])
    faults = [{"rank": 1, "step": forward, "phase": "forward"}, {"rank": 0, "step": backward, "phase": "backward"},
              {"rank": 1, "step": save, "phase": "save"}]
    print(f"SIGKILL in the forward of step {forward}, the backward of step {backward}, the async save after step "
          f"{save}")
    root = tmp_path / "job"
    with etcd_server(tmp_path) as etcd:
        codes, outputs, logs, reports = launch_elastic("recovery_run.py", 2, root, STEPS, SAVE_EVERY,
                                                       json.dumps(faults), etcd=etcd, job_id="kills",
                                                       fresh=[root])
    assert codes == [0], outputs[0][-4000:]
    lost = _lost_to_signals(outputs[0])
    fired = [json.loads((root / "faults" / f"fired-{i}").read_text())["attempt"] for i in range(3)]
    assert fired == sorted(set(fired)), fired  # each fault once, in its own attempt
    starts, stopped = _history(root)
    # each restart resumed from the last checkpoint committed before its fault: never the save the kill interrupted
    resumed = [step for _, step in starts]
    want = [0, _committed_before(forward), _committed_before(backward), save - SAVE_EVERY]
    assert (resumed == want if not lost else len(resumed) <= 4 + lost) and not stopped, starts
    assert outputs[0].count("Pod failed") == 3 + lost, outputs[0][-4000:]
    for report in reports.values():
        values = report["values"]
        assert "crash" not in values, values["crash"]
        assert values["attempt"] == len(starts) and values["steps_done"] == STEPS
        assert len(values["losses"]) == STEPS and values["losses"] == values["uninterrupted"], values
        # one all-reduce of 8 bytes per step boundary of the attempt that finished
        assert values["boundary_collectives"] == STEPS - (save - SAVE_EVERY), values
        assert values["boundary_bytes"] == 8 * values["boundary_collectives"]
    # keep_latest=2: the older ones pruned by rank 0
    assert reports["rank0"]["values"]["checkpoints"] == [f"checkpoint-{STEPS - SAVE_EVERY}", f"checkpoint-{STEPS}"]
    print(f"losses {reports['rank0']['values']['losses']}")


def test_sigterm_to_one_rank_saves_and_stops_every_rank_and_the_next_launch_resumes_exactly(tmp_path):
    step = 5
    root = tmp_path / "job"
    with etcd_server(tmp_path) as etcd:  # elastic: a clean stop is not restarted
        codes, outputs, logs, reports = launch_elastic("recovery_run.py", 2, root, STEPS, SAVE_EVERY,
                                                       json.dumps([{"rank": 1, "step": step, "phase": "sigterm"}]),
                                                       etcd=etcd, job_id="preempted", fresh=[root])
    assert codes == [0] and "Pod failed" not in outputs[0], outputs[0][-4000:]
    stopped = [reports[f"rank{rank}"] for rank in range(2)]
    for report in stopped:  # agreed at the boundary after the step, acted on at the next: every rank alike
        values = report["values"]
        assert "crash" not in values, values["crash"]
        assert values["attempt"] == 1 and values["preempted"] == 1 and values["steps_done"] == step + 1, values
        assert values["latest"] == str(root / f"checkpoint-{step + 1}")
        assert "uninterrupted" not in values
    resumed = launch("recovery_run.py", 2, root, STEPS, SAVE_EVERY, "[]")
    for report, before in zip(resumed, stopped):
        values = report["values"]
        assert "crash" not in values, values["crash"]
        assert values["resumed_from"] == str(root / f"checkpoint-{step + 1}") and values["attempt"] == 2
        assert values["losses"][:step + 1] == before["values"]["losses"]
        assert values["losses"] == values["uninterrupted"] and len(values["losses"]) == STEPS


def test_a_step_failing_on_every_attempt_stops_the_job_with_one_message(tmp_path):
    root = tmp_path / "job"
    with etcd_server(tmp_path) as etcd:
        codes, outputs, logs, reports = launch_elastic("recovery_run.py", 2, root, STEPS, SAVE_EVERY,
                                                       json.dumps([{"rank": 1, "step": 5, "phase": "raise"}]),
                                                       etcd=etcd, job_id="loop", fresh=[root])
    assert codes == [1], outputs[0][-4000:]  # pcp-launch: the crash loop is a failure
    message = outputs[0].strip().splitlines()[-1]
    assert message.startswith("paddle_cp: step 5 failed in each of the last 2 attempts"), outputs[0][-3000:]
    assert "the last resumed after step 2" in message and "BadSample: a bad sample in step 5" in message, message
    assert "(attempt 1, rank 1)" in message
    starts, stopped = _history(root)
    # two attempts failed at step 5; the third stopped the job at its start, with --max_restart 6 left unspent
    assert [attempt for attempt, _ in starts] == list(range(1, 4 + _lost_to_signals(outputs[0]))), starts
    assert stopped == [starts[-1][0]] and not reports


def test_a_lost_node_resumes_on_the_rank_left_like_one_card(tmp_path):
    root = tmp_path / "job"
    # two pods ("nodes") of one rank; rank 1's pod dies with its launcher. The first pod waits --elastic_timeout for
    # the second to register (a loaded machine takes seconds to start a launch); the pod left waits as long again
    # for a pod that does not come back, then restarts alone
    with etcd_server(tmp_path) as etcd:
        codes, outputs, logs, reports = launch_elastic("recovery_run.py", 1, root, STEPS, SAVE_EVERY,
                                                       json.dumps([{"rank": 1, "step": 7, "phase": "node"}]),
                                                       etcd=etcd, job_id="shrink", pods=2, elastic_timeout=20,
                                                       fresh=[root])
    assert sorted(code == 0 for code in codes) == [False, True], (codes, outputs)
    assert json.loads((root / "faults" / "fired-0").read_text())["attempt"] == 1  # the job started on both pods
    values = reports["rank0"]["values"]
    assert "crash" not in values, values["crash"]
    assert values["world"] == 1 and values["resumed_from"] == str(root / f"checkpoint-{_committed_before(7)}"), values
    assert _history(root)[0][-1] == (values["attempt"], _committed_before(7))
    gap = max(abs(a - b) for a, b in zip(values["losses"], values["uninterrupted"]))  # one card's
    assert len(values["losses"]) == STEPS and gap < 1e-5, (gap, values)
    print(f"2 ranks, then 1 after step {_committed_before(7)}: largest difference from one card {gap:.1e}")
