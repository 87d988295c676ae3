"""Whether a forward now runs inside a recompute call (activations/recompute.py, once installed: its first run
and its replay in backward) or as a sequence tile's replay. What such a forward saves for its backward is either
read by the backward that follows the replay at once, or dropped at once (a reentrant call's first run has
gradients off; a non-reentrant one's saves placeholders): a layer whose activations are meant to be rebuilt
may record a graph only there, and ring attention keeps its received k/v there (attention/algorithms/ring.py)."""
from __future__ import annotations

import contextlib

import paddle

from .. import runtime


@contextlib.contextmanager
def replaying():
    """Runs inside are in_replay(); each run starts its own count of what `hold_briefly` granted."""
    state = runtime.state
    state.replay_depth += 1
    outer, state.replay_held = state.replay_held, 0
    try:
        yield
    finally:
        state.replay_depth -= 1
        state.replay_held = outer


def in_replay():
    return runtime.state.replay_depth > 0


def saved_only_briefly():
    """Whether what a forward called now saves for its backward is read by a backward that follows at once (a
    replay) or dropped at once (a non-reentrant recompute's first run saves placeholders), rather than held until
    the step's backward reaches its layer. Asked before a PyLayer's forward runs (Paddle runs it with gradients
    off); with gradients off nothing is saved at all."""
    return paddle.is_grad_enabled() and in_replay()


def hold_briefly(nbytes, limit):
    """Whether a forward called where saved_only_briefly() may keep `nbytes` more for its backward: what this run's
    forwards kept before it, with them, stays within `limit` (a run of several layers, a whole model's recompute
    call, holds every layer's until its backward); granted bytes are counted. Both runs of a recompute call make
    the same calls in the same order, so they decide alike."""
    state = runtime.state
    if state.replay_held + nbytes > limit:
        return False
    state.replay_held += nbytes
    return True
