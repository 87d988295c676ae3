"""Startup collectives (the parallel env, each process group's rendezvous) are bounded like every other:
a rank whose peer never arrives exits after the timeout instead of waiting forever."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import paddle.distributed as dist

from launcher import ROOT
from paddle_cp import mesh as mesh_lib
from paddle_cp import runtime


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_parallel_env_whose_peer_never_arrives_ends_after_the_timeout():
    """Rank 0 of 2 starts alone: Paddle's rendezvous waits in C++ holding the GIL (no Python thread
    runs), so faulthandler's C thread ends it, printing where it waited."""
    ports = _free_ports(2)
    env = dict(os.environ, PADDLE_TRAINER_ID="0", PADDLE_TRAINERS_NUM="2", PADDLE_RANK_IN_NODE="0",
               PADDLE_LOCAL_SIZE="2", PADDLE_CURRENT_ENDPOINT=f"127.0.0.1:{ports[0]}",
               PADDLE_TRAINER_ENDPOINTS=",".join(f"127.0.0.1:{p}" for p in ports))
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, %r)
        import paddle_cp as pcp
        from paddle_cp import mesh
        pcp.set_timeout(2)
        mesh.ensure_initialized()
        print("not reached")
    """ % str(ROOT))
    with tempfile.TemporaryFile("w+") as out:
        # its own session: Paddle's rendezvous server process outlives the rank, and is ended with it here
        proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        started = time.monotonic()
        try:
            returncode = proc.wait(timeout=60)
        finally:
            waited = time.monotonic() - started
            _end_session(proc.pid)
        out.seek(0)
        log = out.read()
    assert returncode != 0 and "not reached" not in log, log[-2000:]
    assert "Timeout (0:00:03)!" in log, log[-2000:]
    assert "in ensure_initialized" in log and "in init_parallel_env" in log
    assert waited < 30


def _end_session(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_group_creation_runs_under_the_watchdog(monkeypatch):
    """Each new_group and the barrier settling it are in flight (bounded) while they wait."""
    seen = []

    def record(op):
        def call(*args, **kwargs):
            seen.append((op, [entry[1:3] for entry in runtime.state.collectives_in_flight.values()]))
        return call

    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(dist, "new_group", record("new_group"))
    monkeypatch.setattr(dist, "barrier", record("barrier"))
    monkeypatch.setattr(mesh_lib, "_own_store", contextlib.nullcontext)  # no store: new_group is recorded
    mesh_lib._new_group((0, 1))
    assert seen == [("new_group", [("new_group", ((0, 1), None))]),
                    ("barrier", [("new_group_barrier", ((0, 1, 2, 3), None))])]
    assert not runtime.state.collectives_in_flight
