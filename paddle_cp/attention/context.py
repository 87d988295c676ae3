"""What the attention needs to know about the global sequence of the current batch.

PrepareContextParallel publishes it while the top layer runs (its length and
documents, which no rank can see from its own tokens); ContextParallel's
attention reads it. The functional APIs take the same facts as arguments.
"""
from __future__ import annotations

from dataclasses import dataclass

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
