"""Run scripts under `paddle.distributed.launch` on CPU ranks and collect what they report."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
EXAMPLES = ROOT / "examples"


def _run(script, nproc, args, tmp, timeout):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKERS), str(EXAMPLES), env.get("PYTHONPATH", "")])
    env["PCP_REPORT_DIR"] = tmp
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--log_dir", os.path.join(tmp, "log"), str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    logs = {log.name: log.read_text() for log in sorted(Path(tmp, "log").glob("workerlog.*"))}
    return proc, logs


# Paddle 3.3.1 on CPU sometimes aborts a rank (SIGABRT, no Python error; seen about once in a hundred launches
# of a suite, mostly at start-up around its TCPStore) whatever the script: such a launch runs once more. A crash
# of the script itself aborts again, and a failure of any other kind is reported at once.
ABORTED = "code -6"


def _run_retrying_an_abort(script, nproc, args, tmp, timeout):
    proc, logs = _run(script, nproc, args, tmp, timeout)
    if proc.returncode != 0 and ABORTED in proc.stdout + proc.stderr:
        warnings.warn(f"a rank of {Path(script).name} on {nproc} ranks aborted (SIGABRT); launched once more")
        shutil.rmtree(tmp)
        os.makedirs(tmp)
        proc, logs = _run(script, nproc, args, tmp, timeout)
    return proc, logs


def _failure(script, nproc, proc, logs):
    tails = "".join(f"\n----- {name}\n{text[-4000:]}" for name, text in logs.items())
    return AssertionError(f"launch of {Path(script).name} on {nproc} ranks failed (exit {proc.returncode})"
                          f"\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}{tails}")


def launch(worker, nproc, *args, timeout=600):
    """Run tests/workers/<worker> on `nproc` gloo ranks; return the per-rank JSON reports (rank order)."""
    return launch_logged(worker, nproc, *args, timeout=timeout)[0]


def launch_logged(worker, nproc, *args, timeout=600):
    """`launch`, and the ranks' logs ({'workerlog.<rank>': text})."""
    with tempfile.TemporaryDirectory(prefix="pcp_launch_") as tmp:
        proc, logs = _run_retrying_an_abort(WORKERS / worker, nproc, args, tmp, timeout)
        paths = [Path(tmp) / f"rank{rank}.json" for rank in range(nproc)]
        if proc.returncode != 0 or not all(p.exists() for p in paths):
            raise _failure(worker, nproc, proc, logs)
        return [json.loads(p.read_text()) for p in paths], logs


def launch_script(script, nproc, *args, timeout=600):
    """Run any script on `nproc` gloo ranks; return rank 0's output."""
    with tempfile.TemporaryDirectory(prefix="pcp_launch_") as tmp:
        proc, logs = _run_retrying_an_abort(script, nproc, args, tmp, timeout)
        if proc.returncode != 0:
            raise _failure(script, nproc, proc, logs)
        return logs.get("workerlog.0", "")


@functools.lru_cache(maxsize=None)
def _launch_kept(worker, nproc, args):
    try:
        return launch(worker, nproc, *args), None
    except AssertionError as failure:  # kept, so a failed launch is not repeated by every test
        return None, failure


def launch_once(worker, nproc, *args):
    """`launch`, run once per (worker, nproc, args) in this pytest process: several tests share it."""
    reports, failure = _launch_kept(worker, nproc, args)
    if failure:
        raise failure
    return reports


def launch_failing(worker, nproc, *args, timeout=600):
    """Run a worker expected to fail: (exit code, per-rank logs, seconds until the launch ended,
    {name: JSON} of what the ranks wrote to PCP_REPORT_DIR, with 'launched_at' = time.time() at start)."""
    import time

    with tempfile.TemporaryDirectory(prefix="pcp_launch_") as tmp:
        started = time.time()
        proc, logs = _run(WORKERS / worker, nproc, args, tmp, timeout)
        ended = time.time()
        written = {p.stem: json.loads(p.read_text()) for p in Path(tmp).glob("*.json")}
        return proc.returncode, logs, {"launched_at": started, "ended_at": ended, **written}
