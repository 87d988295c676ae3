"""What the attention needs to know about the global sequence of the current batch.

PrepareContextParallel publishes it while the top layer runs (its length and
documents, which no rank can see from its own tokens); ContextParallel's
attention reads it. A recompute call made meanwhile carries it into its replay
in backward (paddle_cp/activations/recompute.py). The functional APIs take the same facts
as arguments.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from ... import runtime
from ...activations import recompute
from ..layout.sequence_layout import SequenceLayout
from ..masks.block_mask import Documents


@dataclass(frozen=True)
class SequenceInfo:
    """`valid`: [batch, seq_len] bool (numpy) from the 2-D attention_mask the model was given:
    False for padding keys, which no query sees (None: no padding). `groups`: the CPGroups the batch is laid
    out over when they are not the ContextParallel plan's sep group (PrepareContextParallel(pool=True)'s dp x
    sep ring), else None."""

    layout: SequenceLayout
    seq_len: int
    documents: Documents | None = None
    valid: np.ndarray | None = None
    groups: object = None

    def micro_batch(self, index, count):
        """The facts of rows [index * b, (index + 1) * b) of `count` equal micro-batches (a pipeline's)."""
        def rows(array):
            if array is None or array.shape[0] == 1:
                return array
            size = array.shape[0] // count
            return array[index * size:(index + 1) * size]

        documents = self.documents
        if documents is not None:
            documents = Documents(rows(documents.start), rows(documents.end), documents.causal_only)
        return SequenceInfo(self.layout, self.seq_len, documents, rows(self.valid), self.groups)


def publish(info):
    runtime.state.batches.append(info)


def retract():
    runtime.state.batches.pop()


def current():
    return runtime.state.batches[-1] if runtime.state.batches else None


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
