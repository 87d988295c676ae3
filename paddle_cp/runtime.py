"""Per-process runtime state: what hooks and collectives record while a model runs.

One object, so a test (or a new training run in the same process) clears all of
it with one `reset()`. Configuration (meshes, process groups, parameter records,
which modules a ContextParallel plan covers) is not runtime state and lives elsewhere.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class RuntimeState:
    sequence_split: bool = False  # is the sequence split over mp at this point of the forward?
    # SequenceParallelBegin's split, waiting for the first block of the region (plans/sequence_parallel.py)
    pending_split: object = None
    # the whole [b, s, h] shape the region's first block was given before that split: what the model's code
    # between the Begin layer and the blocks saw (a later pipeline stage's stand-ins give it that shape)
    sequence_whole_shape: tuple | None = None
    bytes_sent: defaultdict = field(default_factory=lambda: defaultdict(int))  # bytes this rank sent, by tag
    collectives_issued: defaultdict = field(default_factory=lambda: defaultdict(int))  # collectives, by tag
    # SequenceInfo of the batches whose top layer is running (innermost last), from PrepareContextParallel
    batches: list = field(default_factory=list)
    # routing.Frame of each ContextParallel layer whose forward is running (innermost last)
    running: list = field(default_factory=list)
    # query-key pairs computed and skipped by attention forwards
    attention_work: dict = field(default_factory=lambda: {"computed": 0, "skipped": 0})
    # one memo per running recompute call: the sep groups whose batch PrepareContextParallel has checked
    # in it, so a replay in backward does not gather again (plans/same_batch.py)
    checked_batches: list = field(default_factory=list)
    # check_parity's reference forward: PrepareContextParallel splits nothing and ContextParallel routes
    # nothing (every rank computes the whole sequence with the model's own attention)
    context_parallel_paused: bool = False
    # pipeline: the factor the script applied to the losses scheduled steps returned since the last
    # optimizer step (`(loss / k).backward()`, a GradScaler's scale); the optimizer applies it
    pipeline_loss_scale: object = None  # a device scalar (the loss gradient), or None
    # pipeline: True (a bool device scalar) once two calls of this step scaled their losses differently
    pipeline_loss_scales_differ: object = None
    # pipeline: the Pipeline (pipeline/runner.py) whose stage forward is running: recompute calls ask it
    pipeline_running: object = None
    # the sep groups (their ranks) whose tensors shard_sequence split by a backend name since their plan's
    # last forward: a batch the plan splits by its documents refuses them (labels in another layout)
    split_by_backend_name: set = field(default_factory=set)
    # PrepareContextParallel plan -> PlanNotes: what its batches showed, for shard_sequence given that plan
    plan_notes: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)


@dataclass
class PlanNotes:
    sharded: set = field(default_factory=set)  # splits shard_sequence used since the plan's last forward
    startend_seen: bool = False  # a forward split a batch by attn_mask_startend_row_indices it was not told of


state = RuntimeState()


def plan_notes(plan):
    """The notes kept for `plan` (made on first use): the plan object itself holds only its arguments."""
    return state.plan_notes.setdefault(plan, PlanNotes())


def reset():
    """Forget everything recorded so far (in place: modules keep their reference to `state`)."""
    state.__dict__.update(RuntimeState().__dict__)
