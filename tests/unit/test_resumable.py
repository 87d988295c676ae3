"""Recovery in one process (no launch): pcp.Resumable killed by an exception and preempted by a signal resumes to
the losses of an uninterrupted run, bit for bit; the crash-loop rule; pruning that spares a checkpoint being read;
the checks of Resumable's arguments; pcp-launch's command."""
import json
import os
import signal

import numpy as np
import paddle
import pytest

import paddle_cp as pcp
from paddle_cp.checkpoint import commit
from paddle_cp.recovery import attempts
from paddle_cp.tools.elastic import cli as elastic_cli

STEPS = 7


def build():
    paddle.seed(0)
    np.random.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.Dropout(0.3), paddle.nn.Linear(8, 1))
    schedule = paddle.optimizer.lr.CosineAnnealingDecay(0.1, T_max=STEPS)
    optimizer = paddle.optimizer.AdamW(learning_rate=schedule, parameters=model.parameters())
    return model, optimizer, schedule


def train(root, fail_at=None, signal_at=None, fresh=False):
    """The run's losses and its Resumable; the step index `fail_at` raises, `signal_at` sends SIGUSR1."""
    model, optimizer, schedule = build()
    # the optimizer's scheduler is resumed without being named in `objects`
    with pcp.Resumable(root, model, optimizer, save_every=2, keep_latest=2, extra={"losses": []}, fresh=fresh) as run:
        for step in run.steps(STEPS):
            x = paddle.randn([3, 4]) + paddle.to_tensor(np.random.rand(3, 4).astype("float32"))  # both generators
            if step == fail_at:
                raise ValueError("a bad sample")
            if step == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            loss = model(x).pow(2).mean()  # dropout: Paddle's generator again
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            schedule.step()
            run.extra["losses"].append(float(loss))
    return run.extra["losses"], run


def test_a_run_failed_then_preempted_resumes_to_the_uninterrupted_losses(tmp_path):
    want, _ = train(str(tmp_path / "uninterrupted"))
    root = str(tmp_path / "job")
    with pytest.raises(ValueError, match="a bad sample"):
        train(root, fail_at=4)
    assert pcp.latest_checkpoint(root) == os.path.join(root, "checkpoint-2")  # checkpoint-4: saved, never published
    history = attempts.read_history(root)
    assert [(a.number, a.resumed_step, a.first_failure["step"]) for a in history] == [(1, 0, 5)]
    assert history[0].first_failure["error"].startswith("ValueError: a bad sample (at ")
    handler = signal.getsignal(signal.SIGUSR1)
    losses, run = train(root, signal_at=3)  # agreed at the boundary after step 4, acted on after step 5
    assert run.preempted == 1 and run.step == 5 and run.resumed_from == os.path.join(root, "checkpoint-2")
    assert signal.getsignal(signal.SIGUSR1) == handler  # restored
    assert pcp.latest_checkpoint(root) == os.path.join(root, "checkpoint-5")
    losses, run = train(root)
    assert run.attempt == 3 and run.step == STEPS and losses == want
    assert [os.path.basename(path) for _, path in commit.complete_checkpoints(root)] == ["checkpoint-6", "checkpoint-7"]
    fresh, run = train(root, fresh=True)
    assert fresh == want and run.attempt == 1


def _attempt(number, failed_at=None, stopped=""):
    failures = ({"rank": 0, "step": failed_at, "error": f"E{number}", "time": number},) if failed_at else ()
    return attempts.Attempt(number, 0, failures, stopped)


def test_the_crash_loop_rule():
    loop = [_attempt(1, 5), _attempt(2, 5), _attempt(3, 5)]
    message = attempts.crash_loop(loop, 3)
    assert message.startswith("paddle_cp: step 5 failed in each of the last 3 attempts (attempts 1-3")
    assert message.endswith("The first error (attempt 1, rank 0): E1")
    assert attempts.crash_loop(loop, 4) is None  # not yet tried 4 times
    assert attempts.crash_loop([_attempt(1, 4), *loop[1:]], 3) is None  # it got further once
    assert attempts.crash_loop([*loop[:2], _attempt(3)], 3) is None  # the last attempt did not fail
    assert attempts.crash_loop([_attempt(1, 5), _attempt(2, 5, stopped="crash loop"), _attempt(3, 5)], 2) is None
    assert attempts.crash_loop(loop, 0) is None  # the rule off


def test_forgetting_the_history_starts_the_count_again(tmp_path):
    root = str(tmp_path)
    for number in (1, 2):
        attempts.start_attempt(root, number, 0, 1)
        attempts.record_failure(root, number, 0, 5, ValueError("bad"))
    assert attempts.crash_loop(attempts.read_history(root), 2) is not None
    assert attempts.enter(root, 2, None, forget=True) == 1 and attempts.read_history(root) == []


def test_pruning_keeps_the_newest_and_any_being_read(tmp_path):
    model, optimizer, _ = build()
    for step in range(4):
        pcp.save_checkpoint(str(tmp_path / f"checkpoint-{step}"), model, optimizer, extra={"step": step})
    with commit.reading(str(tmp_path / "checkpoint-0")):
        removed = commit.prune_checkpoints(str(tmp_path), keep_latest=2)
    assert removed == [str(tmp_path / "checkpoint-1")]  # checkpoint-0 is being read
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-0", "checkpoint-2", "checkpoint-3"]
    assert commit.prune_checkpoints(str(tmp_path), keep_latest=2) == [str(tmp_path / "checkpoint-0")]


@pytest.mark.parametrize("kwargs, error, words", [
    ({"save_every": -1}, ValueError, "save_every"),
    ({"save_every": 2, "keep_latest": 0}, ValueError, "keep_latest"),
    ({"save_every": 2, "tries_per_step": -1}, ValueError, "tries_per_step"),
    ({"save_every": 2, "objects": {"lr": object()}}, TypeError, "state_dict() and set_state_dict()"),
    ({"save_every": 2, "extra": {"x": object()}}, TypeError, "JSON-serializable"),
    ({"save_every": 2, "async_save": 1}, TypeError, "async_save"),
])
def test_resumable_arguments_are_checked_before_anything_runs(tmp_path, kwargs, error, words):
    model, optimizer, _ = build()
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        pcp.Resumable(str(tmp_path), model, optimizer, **kwargs)
    assert not os.listdir(tmp_path)


def test_pcp_launch_adds_the_elastic_defaults_only_for_an_etcd_master():
    etcd = ["--master", "etcd://10.0.0.1:2379", "--nnodes", "2", "train.py"]
    assert elastic_cli.launch_command(etcd)[3:] == ["--elastic_level", "1", "--max_restart", "100", *etcd]
    mine = ["--master=etcd://h:1", "--max_restart=5", "train.py"]
    assert elastic_cli.launch_command(mine)[3:] == ["--elastic_level", "1", *mine]
    plain = ["--nproc_per_node", "2", "train.py"]
    assert elastic_cli.launch_command(plain)[3:] == plain
    assert json.loads(json.dumps(elastic_cli.ELASTIC_DEFAULTS)) == {"--elastic_level": "1", "--max_restart": "100"}


def test_the_trainers_preemption_callback_saves_and_stops_a_step_after_the_signal():
    """paddle_cp's Trainer adds it on more than one rank; in one process the ranks' sum is this rank's flag."""
    from paddleformers.trainer import TrainerControl

    from paddle_cp.integrations.paddleformers.preemption import PreemptionStop

    callback, handler = PreemptionStop(), signal.getsignal(signal.SIGTERM)
    callback.on_train_begin(None, None, TrainerControl())
    controls = []
    for step in range(3):
        if step == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # noted, not acted on here
        control = callback.on_step_end(None, None, TrainerControl())
        controls.append((control.should_save, control.should_training_stop))
    callback.on_train_end(None, None, TrainerControl())
    assert controls == [(False, False), (True, True), (True, True)]
    assert signal.getsignal(signal.SIGTERM) == handler
