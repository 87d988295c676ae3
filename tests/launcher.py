"""Run scripts under `paddle.distributed.launch` on CPU ranks and collect what they report, through the one
launcher (paddle_cp/tools/launcher.py): a launch whose rank aborts (SIGABRT) runs once more. Every launch of the
suite goes through here, the tools that launch ranks themselves too (`run_tool`)."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
from pathlib import Path

from paddle_cp.tools import launcher as ranks

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
EXAMPLES = ROOT / "examples"


def env_for_ranks(**extra):
    """The environment of a launch (or of a tool that launches ranks): this checkout's paddle_cp, the workers and
    the examples importable, one thread per rank, CPU ranks."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKERS), str(EXAMPLES), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _run(script, nproc, args, tmp, timeout):
    cmd = ranks.command(nproc, script, args, os.path.join(tmp, "log"))
    proc = subprocess.run(cmd, env=env_for_ranks(PCP_REPORT_DIR=tmp), capture_output=True, text=True,
                          timeout=timeout)
    logs = {log.name: log.read_text() for log in sorted(Path(tmp, "log").glob("workerlog.*"))}
    return proc, logs


def _run_retrying_an_abort(script, nproc, args, tmp, timeout):
    def run():
        proc, logs = _run(script, nproc, args, tmp, timeout)
        return proc.returncode, proc.stdout + proc.stderr, (proc, logs)

    return ranks.retrying_an_abort(run, f"{Path(script).name} on {nproc} ranks", fresh=[tmp])[2]


def run_tool(cmd, timeout=600, fresh=(), cwd=None, **env):
    """`subprocess.run(cmd)` for a command that launches ranks itself (pcp-bench, pcp-memory, pcp-train, ...),
    with the launcher's handling of an aborted rank; `fresh`: folders emptied before a second run; `env`:
    variables added to the ranks' environment."""
    def run():
        proc = subprocess.run(list(map(str, cmd)), env=env_for_ranks(**env), capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)
        return proc.returncode, proc.stdout + proc.stderr, proc

    return ranks.retrying_an_abort(run, " ".join(map(str, cmd[1:3])), fresh=fresh)[2]


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
        def run():
            started = time.time()
            proc, logs = _run(WORKERS / worker, nproc, args, tmp, timeout)
            return proc.returncode, proc.stdout + proc.stderr, (proc, logs, started, time.time())

        proc, logs, started, ended = ranks.retrying_an_abort(run, f"{worker} on {nproc} ranks", fresh=[tmp])[2]
        written = {p.stem: json.loads(p.read_text()) for p in Path(tmp).glob("*.json")}
        return proc.returncode, logs, {"launched_at": started, "ended_at": ended, **written}
