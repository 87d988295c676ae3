"""Whether a forward now runs as a replay in backward (a recompute call's or a sequence tile's): a layer whose
activations are meant to be rebuilt may record a graph only then."""
from __future__ import annotations

import contextlib

_depth = [0]


@contextlib.contextmanager
def replaying():
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1


def in_replay():
    return _depth[0] > 0
