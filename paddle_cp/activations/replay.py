"""Whether a forward now runs as a replay in backward (a recompute call's or a sequence tile's): a layer whose
activations are meant to be rebuilt may record a graph only then."""
from __future__ import annotations

import contextlib

from .. import runtime


@contextlib.contextmanager
def replaying():
    runtime.state.replay_depth += 1
    try:
        yield
    finally:
        runtime.state.replay_depth -= 1


def in_replay():
    return runtime.state.replay_depth > 0
