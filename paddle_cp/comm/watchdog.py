"""A bound on every collective paddle_cp issues: a rank that waits past the timeout says what it
waited for and exits non-zero, so `paddle.distributed.launch` stops the whole job.

Gloo gives up only after its fixed 30 s and NCCL never does, so a stalled peer would
otherwise hang the job (on NCCL forever). The guard on each collective is cheap: it
stores what is in flight in a dict entry; a daemon thread polls the entries. On GPU a
collective returns before it completes: the guard records an event on the current
stream and the in-flight entry stays until the event has passed.
"""
from __future__ import annotations

import faulthandler
import math
import os
import sys
import threading
import time
from contextlib import contextmanager

import paddle

from ..runtime import installed, state

DEFAULT_TIMEOUT = 1800.0  # fits slow first steps (compilation, data loading) yet never waits forever
ENV_VAR = "PCP_TIMEOUT"
_POLL = 0.2


def _checked(seconds, source):
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise ValueError(f"{source} must be a positive number of seconds, got {seconds!r}")
    return float(seconds)


def set_timeout(seconds):
    """Bound every paddle_cp collective on this rank to `seconds` (call it on every rank)."""
    installed.collective_timeout = _checked(seconds, "set_timeout(seconds)")


def get_timeout():
    """The timeout in seconds: set_timeout's, else the PCP_TIMEOUT environment variable, else the default."""
    if installed.collective_timeout is not None:
        return installed.collective_timeout
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = raw
    return _checked(value, f"environment variable {ENV_VAR}")


@contextmanager
def guard(op, ranks, peers=None):
    """Mark a collective `op` over the group of global `ranks` as in flight while the block runs;
    `peers`: the ranks it waits for (default: the others in the group)."""
    _ensure_thread()
    token = next(installed.collective_tokens)
    state.collectives_in_flight[token] = entry = (time.monotonic(), op, (tuple(ranks), peers), None)
    try:
        yield
    except Exception:
        # the backend gave up first (gloo after its fixed 30 s, a peer's closed connection): say which
        # collective and which peers, as the watchdog would, beside the backend's own terse error
        _report(op, entry[2], f"failed after {time.monotonic() - entry[0]:.1f} s", "the backend raised")
        raise
    finally:
        event = _completion_event()
        if event is None:
            state.collectives_in_flight.pop(token, None)
        else:
            state.collectives_in_flight[token] = (*entry[:3], event)


@contextmanager
def startup_guard(op, ranks):
    """`guard` for a startup call (the parallel env, a process group's rendezvous) that may wait in C++
    holding the GIL, where the watchdog thread cannot run: faulthandler's own C thread bounds it too, a
    second after the timeout (it prints "Timeout" and every thread's stack, this call among them, and
    exits 1). It replaces any faulthandler.dump_traceback_later the script had set."""
    faulthandler.dump_traceback_later(get_timeout() + 1.0, exit=True)
    try:
        with guard(op, ranks):
            yield
    finally:
        faulthandler.cancel_dump_traceback_later()


_CUDA = paddle.is_compiled_with_cuda()


def _completion_event():
    if not _CUDA or not paddle.get_device().startswith("gpu"):
        return None
    event = paddle.device.cuda.Event()
    event.record()
    return event


def _ensure_thread():
    if installed.watchdog is None:
        get_timeout()  # a bad PCP_TIMEOUT raises here, on every rank, before the first collective
        installed.watchdog = threading.Thread(target=_watch, name="paddle_cp-watchdog", daemon=True)
        installed.watchdog.start()


def _watch():
    while True:
        time.sleep(_POLL)
        limit, now = get_timeout(), time.monotonic()
        in_flight = state.collectives_in_flight
        for key, (started, op, group, event) in list(in_flight.items()):
            if event is not None and event.query():
                in_flight.pop(key, None)
            elif now - started > limit:
                _give_up(op, group, now - started, limit)


def _report(op, group, what, outcome):
    rank = paddle.distributed.get_rank()
    ranks, peers = group
    peers = sorted(set(peers or ranks) - {rank})
    sys.stderr.write(f"paddle_cp: rank {rank} {what} in collective '{op}' over group {list(ranks)} "
                     f"waiting for ranks {peers}: a peer stalled or died; {outcome}\n")
    sys.stderr.flush()
    sys.stdout.flush()


def _give_up(op, group, waited, limit):
    _report(op, group, f"waited {waited:.1f} s (timeout {limit:g} s, set by pcp.set_timeout or {ENV_VAR})",
            "exiting")
    os._exit(17)
