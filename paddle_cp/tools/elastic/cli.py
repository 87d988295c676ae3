"""pcp-launch: `python -m paddle.distributed.launch` as it is, for jobs that restart without a person.

    etcd --listen-client-urls http://0.0.0.0:2379 --advertise-client-urls http://HOST:2379 &   (one per job)
    pcp-launch --master etcd://HOST:2379 --nnodes 2 --nproc_per_node 8 --job_id run1 train.py ...   (every node)

Paddle's launch restarts the job when a rank fails only in its elastic mode (an etcd master): every rank is
stopped and started again, and a script under `pcp.Resumable` continues from its last committed checkpoint.
This wrapper adds only what Paddle's launch lacks for that:
- a crash loop ends the job: Paddle restarts up to `--max_restart` times whether or not a restart gets further.
  `pcp.Resumable` stops a job whose same step failed on `tries_per_step` attempts in a row: its ranks exit 0 (so
  Paddle does not restart it) after writing why to the file named by PCP_STOP_FILE; this prints that one message
  and exits 1. With an etcd master and no `--max_restart`, the budget is 100 restarts: the rule, not the count,
  stops a job that makes no progress (Paddle's default, 3, would end a days-long run after its fifth lost rank);
  with no `--elastic_level`, 1 (restart; Paddle's default, -1, stops the job at the first failure).
- a signal to this command reaches the ranks through Paddle's launch, which stops them with SIGTERM and SIGKILLs
  them 30 s later: SIGTERM and SIGUSR1 (a scheduler's notice, which Paddle's launch would die of) are passed on
  as SIGTERM, SIGINT as itself (Paddle's launch runs in a session of its own, so a terminal's Ctrl-C is not
  delivered twice). Ranks under `pcp.Resumable` save at the next step boundary and exit 0.
- Paddle's launch imports the `etcd3` client, whose generated protobuf code imports only under protobuf's Python
  implementation with the protobuf Paddle installs (4 and later: "Descriptors cannot be created directly"):
  PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python, unless the environment sets it.
Every argument is Paddle's launch's own (`python -m paddle.distributed.launch --help`).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from ...recovery.attempts import STOP_FILE_VAR
from ..launcher import ROOT

ELASTIC_DEFAULTS = {"--elastic_level": "1", "--max_restart": "100"}
PASSED_ON = {signal.SIGTERM: signal.SIGTERM, signal.SIGUSR1: signal.SIGTERM, signal.SIGINT: signal.SIGINT}
CRASH_LOOP_EXIT = 1


def _given(argv, flag):
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def _master(argv):
    for i, arg in enumerate(argv):
        if arg == "--master" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--master="):
            return arg.split("=", 1)[1]
    return None


def launch_command(argv):
    """Paddle's launch with `argv`, and the elastic defaults where an etcd master asks for them."""
    defaults = []
    if (_master(argv) or "").startswith("etcd://"):
        for flag, value in ELASTIC_DEFAULTS.items():
            if not _given(argv, flag):
                defaults += [flag, value]
    return [sys.executable, "-m", "paddle.distributed.launch", *defaults, *argv]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    with tempfile.TemporaryDirectory(prefix="pcp_launch_") as tmp:
        stop_file = os.path.join(tmp, "stopped")
        env = dict(os.environ, **{STOP_FILE_VAR: stop_file})
        env.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        launch = subprocess.Popen(launch_command(argv), env=env, start_new_session=True)
        for received, sent in PASSED_ON.items():
            signal.signal(received, lambda signum, frame, sent=sent: launch.send_signal(sent))
        code = launch.wait()
        if os.path.isfile(stop_file):
            with open(stop_file) as f:
                print(f.read(), file=sys.stderr, flush=True)
            return CRASH_LOOP_EXIT
        return code
