"""What the attention needs to know about the global sequence of the current batch.

PrepareContextParallel publishes it while the top layer runs (its length and
documents, which no rank can see from its own tokens); ContextParallel's
attention reads it. A recompute call made meanwhile carries it into its replay
in backward (paddle_cp/recompute.py). The functional APIs take the same facts
as arguments.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from .. import recompute
from .layout import SequenceLayout
from .mask import Documents


@dataclass(frozen=True)
class SequenceInfo:
    layout: SequenceLayout
    seq_len: int
    documents: Documents | None = None


_current = []


def publish(info):
    _current.append(info)


def retract():
    _current.pop()


def current():
    return _current[-1] if _current else None


@contextlib.contextmanager
def published(info):
    publish(info)
    try:
        yield
    finally:
        retract()


def _capture():
    info = current()
    return None if info is None else lambda: published(info)


recompute.carry(_capture)
