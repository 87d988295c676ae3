"""A batch's facts, made once where its inputs are split, read by the attention, the mixers and shard_sequence.

PrepareContextParallel makes the Batch of each forward from the inputs of its top layer (its length,
layout and documents, which no rank can see from its own tokens, and its padding) and publishes it while
that layer runs; ContextParallel's attention and token mixers read it (`current()`). A recompute call made
meanwhile carries it into its replay in backward (paddle_cp/activations/recompute.py); a pipeline stage
publishes each micro-batch's rows of it. shard_sequence, given the plan, splits the batch's other tensors
(labels) in its layout: after the forward it reuses that forward's Batch, before it makes one that the
forward then checks. The functional APIs take the same facts as arguments. All of it lives in
`runtime.state.batches` (runtime.BatchRecords).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import numpy as np

from ... import runtime
from ...activations import recompute
from ..layout.sequence_layout import SequenceLayout
from ..masks.block_mask import Documents


@dataclass(frozen=True)
class Batch:
    """`layout`: the batch's (its split may follow its documents), over the sep ranks `group` (a MeshGroup);
    `valid`: [batch, seq_len] bool (numpy) from the 2-D attention_mask the model was given: False for
    padding keys, which no query sees (None: no padding); `run`: the SepRun of the plan that split the
    model's inputs (its backend's ring and Ulysses groups; None for a Batch shard_sequence made);
    `plan`: the PrepareContextParallel whose layout it follows (None: a backend name's 2N chunks);
    `pool_groups`: the CPGroups of a PrepareContextParallel(pool=True)'s ring over every dp x sep rank, whose
    global batch this is (its rows joined into one), else None; `vision`: a vision-language batch's VisionLayout
    when its vision tower is split (plans/vision_split.py), else None. The masks
    and exchange plans its layers share are kept by its layout (`layout.plans`, layout/batch_plans.py), made
    by its first attention layer from these facts."""

    layout: SequenceLayout
    seq_len: int
    documents: Documents | None = None
    valid: np.ndarray | None = None
    group: object = None
    run: object = None
    plan: object = None
    pool_groups: object = None
    vision: object = None

    @property
    def groups(self):
        """The sep group (a pool's dp x sep ring) and its Ulysses and ring parts the attention of this batch runs over."""
        return self.pool_groups if self.pool_groups is not None else self.run.groups

    def same_documents(self, documents):
        """Whether `documents` (a Documents or None) are this batch's."""
        mine = self.documents
        if mine is None or documents is None:
            return mine is documents
        return (mine.causal_only == documents.causal_only and np.array_equal(mine.start, documents.start)
                and np.array_equal(mine.end, documents.end))

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
        return replace(self, documents=documents, valid=rows(self.valid))


def publish(batch):
    runtime.state.batches.running.append(batch)


def retract():
    runtime.state.batches.running.pop()


def _innermost(stack):
    return stack[-1] if stack else None


def current():
    return _innermost(runtime.state.batches.running)


@contextlib.contextmanager
def published(batch):
    publish(batch)
    try:
        yield
    finally:
        retract()


def begin_merge(batch):
    """A vision-language model's forward chose `batch`: its vision tower and merge run before its language model
    splits it (`merging()` is it meanwhile)."""
    runtime.state.batches.merging.append(batch)


def end_merge():
    runtime.state.batches.merging.pop()


def merging():
    return _innermost(runtime.state.batches.merging)


def record_split(batch):
    """A forward split `batch` over its group: shard_sequence, given the same plan and documents, reuses it."""
    runtime.state.batches.last[batch.group.ranks] = batch


def last_split(group):
    """The Batch the last forward over the sep `group` split (None before any)."""
    return runtime.state.batches.last.get(group.ranks)


def record_shard(batch):
    """shard_sequence split a tensor of the coming batch over `batch.group` in `batch.layout`: checked at its
    forward (`take_shards`). A tensor split in the last forward's Batch (labels after their forward) belongs to
    that forward, not to the coming one."""
    state = runtime.state.batches
    if state.last.get(batch.group.ranks) is not batch:
        state.sharded.setdefault(batch.group.ranks, []).append(batch)


def take_shards(group):
    """The Batches shard_sequence split tensors in over `group` since its last forward, forgotten."""
    return runtime.state.batches.sharded.pop(group.ranks, [])


def split_alike(group, plan, seq_len, documents):
    """A Batch `plan` split over `group` for `documents` (joined rows under a pool) and `seq_len` tokens: the
    latest shard_sequence made for the coming forward, else the last forward's (None: neither). Its layout
    serves again: a batch's layout is chosen once a step."""
    state = runtime.state.batches
    for made in [*reversed(state.sharded.get(group.ranks, [])), state.last.get(group.ranks)]:
        if made is not None and made.plan is plan and made.seq_len == seq_len and made.same_documents(documents):
            return made
    return None


def _capture():
    batch = current()
    return None if batch is None else lambda: published(batch)


recompute.carry(_capture)
