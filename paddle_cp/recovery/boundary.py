"""What the ranks agree on at each step boundary, in one all-reduce of one int64: how many ranks received a
preemption signal, and how many are still writing their files of an async checkpoint save.

The sum is read on the host one step later (comm/deferred.py), so the boundary never waits for the device: on
a GPU the host has queued the next step's kernels before the value it reads was even reduced. Every rank reads
the same sum at the same boundary, so they act on it together: a preemption stops every rank after the same
step, and an async save is published once no rank is writing (Megatron's `--exit-signal-handler` and its
finalisation of async saves, in one number). Cost per step: one all-reduce of 8 bytes (tag `step_boundary`).
"""
from __future__ import annotations

from dataclasses import dataclass

import paddle

from ..comm import collectives
from ..comm.deferred import DeferredRead

WRITING = 1 << 32  # a rank still writing adds this; a preempted one adds 1 (fewer than 2**32 ranks)


@dataclass(frozen=True)
class Agreed:
    """The ranks' flags as summed at the previous boundary."""

    preempted: int = 0  # ranks that had received a preemption signal
    writing: int = 0  # ranks whose async save was still writing


class StepBoundary:
    def __init__(self, group):
        """`group`: the MeshGroup of every rank (None in one process: the flags are this rank's own)."""
        self.group = group
        self._pending = None  # DeferredRead of the last boundary's sum

    def agreed(self):
        """The sum of the flags contributed at the previous boundary (all zero before the first)."""
        total = int(self._pending.result()[0]) if self._pending is not None else 0
        return Agreed(preempted=total % WRITING, writing=total // WRITING)

    def contribute(self, preempted, writing):
        """This rank's flags at this boundary, summed over the ranks (read at the next one)."""
        flags = paddle.full([1], int(bool(preempted)) + WRITING * int(bool(writing)), dtype="int64")
        if self.group is not None:
            collectives.all_reduce(self.group, flags, tag="step_boundary")
        self._pending = DeferredRead(flags)
