"""Preemption signals: SIGTERM (a scheduler's, or Paddle's launch stopping its ranks) and SIGUSR1 (sent ahead of a
deadline, as Slurm's `--signal` does) are noted, never acted on where they land: a rank stopping mid-step would
leave its peers inside a collective. The ranks agree on the note at the next step boundary (boundary.py), save,
and exit cleanly. Repeated signals are one request: Paddle's launch sends SIGTERM up to three times, then waits
30 s before SIGKILL.
"""
from __future__ import annotations

import signal

from ..runtime import installed, state

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _note(signum, frame):
    state.preemption_signal = signum


def note_preemptions():
    """Route the preemption signals to the note (main thread only, as Python's signal module requires), which
    starts empty: a signal acted on by an earlier run in this process is not this run's."""
    state.preemption_signal = 0
    for signum in PREEMPTION_SIGNALS:
        if signum not in installed.preemption_handlers:
            installed.preemption_handlers[signum] = signal.getsignal(signum)
        signal.signal(signum, _note)


def restore_handlers():
    """The handlers there were before note_preemptions (the default where the previous one was not Python's:
    Paddle installs C handlers)."""
    for signum, previous in installed.preemption_handlers.items():
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    installed.preemption_handlers.clear()


def received():
    """The preemption signal this rank received (its number), 0 if none."""
    return state.preemption_signal
