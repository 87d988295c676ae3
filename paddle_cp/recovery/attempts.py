"""The attempts of one job, kept beside its checkpoints, and the rule that stops a crash loop.

Paddle's elastic launch restarts a failed job up to `--max_restart` times whether or not it moved on; a
step that fails every time (a bad sample, a bug) would burn every restart, each with the same traceback.
Every attempt of a job appends a line to `<root>/pcp_recovery/attempts.jsonl` (rank 0, at its start); a
rank whose step raises writes `failure-<attempt>-<rank>.json` (the step and the error) before it exits.
Steps are numbered from 1 (step n ends with n steps done, the state `checkpoint-n` holds). `crash_loop(history,
tries)` is the rule: the last `tries` attempts each failed first at the same step. `enter` applies it as an attempt
starts (pcp.Resumable, paddle_cp's Trainer): the attempt that finds it appends a `stopped` line, so a relaunch after
a fix starts a new count, and ends the job on every rank.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, replace

import paddle.distributed as dist

from ..checkpoint.agree import count_failures

FOLDER = "pcp_recovery"
ATTEMPTS = "attempts.jsonl"
STOP_FILE_VAR = "PCP_STOP_FILE"  # where a rank writes why it stopped the job (pcp-launch reads it)


@dataclass(frozen=True)
class Attempt:
    number: int
    resumed_step: int
    failures: tuple = ()  # ({"rank", "step", "error", "time"}, ...) in the order they happened
    stopped: str = ""  # why this attempt stopped the job at its start ("" if it did not)

    @property
    def first_failure(self):
        return self.failures[0] if self.failures else None


def folder(root):
    return os.path.join(root, FOLDER)


def read_history(root):
    """[Attempt] of the job whose checkpoints live under `root`, oldest first."""
    path = os.path.join(folder(root), ATTEMPTS)
    if not os.path.isfile(path):
        return []
    failures = {}
    for name in glob.glob(os.path.join(folder(root), "failure-*.json")):
        try:
            with open(name) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue  # unreadable (the disk, a hand edit): nothing to learn from
        failures.setdefault(record["attempt"], []).append(record)
    attempts = {}
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if entry.get("stopped"):
                attempts[entry["attempt"]] = replace(attempts[entry["attempt"]], stopped=entry["stopped"])
                continue
            number = entry["attempt"]
            found = tuple(sorted(failures.get(number, []), key=lambda record: record["time"]))
            attempts[number] = Attempt(number, entry["resumed_step"], found)
    return [attempts[number] for number in sorted(attempts)]


def start_attempt(root, number, resumed_step, world):
    """Rank 0: the attempt `number` starts from `resumed_step` on `world` ranks."""
    _append(root, {"attempt": number, "resumed_step": resumed_step, "world": world, "started_at": time.time()})


def mark_stopped(root, number, why):
    """Rank 0: attempt `number` ended the job at its start (`why`)."""
    _append(root, {"attempt": number, "stopped": why})


def _append(root, entry):
    os.makedirs(folder(root), exist_ok=True)
    with open(os.path.join(folder(root), ATTEMPTS), "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def record_failure(root, attempt, rank, step, exc):
    """This rank's step `step` (numbered from 1) of attempt `attempt` raised `exc`."""
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    record = {"attempt": attempt, "rank": rank, "step": step, "error": f"{type(exc).__name__}: {exc}{at}",
              "time": time.time()}
    os.makedirs(folder(root), exist_ok=True)
    path = os.path.join(folder(root), f"failure-{attempt}-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def crash_loop(history, tries):
    """The message that stops the job, or None: the last `tries` attempts (none of them a stop already) each failed
    first at the same step (wherever they resumed: a checkpoint committed in between is no way past it); `tries` 0:
    never."""
    if tries == 0:
        return None
    last = history[-tries:]
    if len(last) < tries or any(attempt.stopped or attempt.first_failure is None for attempt in last):
        return None
    if len({attempt.first_failure["step"] for attempt in last}) > 1:
        return None
    first = last[0].first_failure
    return (f"paddle_cp: step {first['step']} failed in each of the last {tries} attempts (attempts "
            f"{last[0].number}-{last[-1].number}, the last resumed after step {last[-1].resumed_step}): stopping "
            f"the job instead of restarting it again. The first error (attempt {last[0].number}, rank "
            f"{first['rank']}): {first['error']}")


def enter(root, tries, group, forget=False):
    """Every rank, as an attempt starts (before rank 0's `start_attempt`): the attempt's number, read from the
    history. If the last `tries` attempts each failed first at one step, the job ends here instead (`stop_job`):
    the ranks agree first (also: none reads the history after rank 0 appends to it). `tries` 0: never;
    `forget`: a new job in `root` (training from scratch), whose count starts again."""
    if forget:
        if dist.get_rank() == 0:
            shutil.rmtree(folder(root), ignore_errors=True)
        count_failures(group, True, "recovery_forget")  # nobody reads the history before it is gone
    history = read_history(root)
    stop = crash_loop(history, tries)
    number = history[-1].number + 1 if history else 1
    if count_failures(group, stop is None, "recovery_start"):
        stop_job(root, number, stop or "paddle_cp: another rank found the job in a crash loop",
                 history[-1].resumed_step if history else 0)
    return number


def stop_job(root, number, message, resumed_step):
    """Attempt `number` ends the job with `message` (rank 0 prints it and records the stop; pcp-launch prints it
    last): every rank exits 0, whatever the script would do next, since Paddle's launch restarts a job whose rank
    exits non-zero (and Paddle 3.3.1's CPU teardown now and then kills an exiting rank with a signal:
    tools/launcher.py)."""
    rank = dist.get_rank()
    if rank == 0:
        print(message, flush=True)
        start_attempt(root, number, resumed_step, dist.get_world_size())
        mark_stopped(root, number, "crash loop")
    stop_file = os.environ.get(STOP_FILE_VAR)
    if stop_file:
        with open(f"{stop_file}.{rank}", "w") as f:
            f.write(message)
        os.replace(f"{stop_file}.{rank}", stop_file)
    _exit_cleanly()


def _exit_cleanly():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
