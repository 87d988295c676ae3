"""SIGTERM or SIGUSR1 to any rank of a Trainer run: every rank saves a checkpoint at the same step and the training
stops, through PaddleFormers' own controls (`should_save`, `should_training_stop`) from a callback at each step's
end. The ranks agree as pcp.Resumable's do (paddle_cp/recovery/boundary.py): one all-reduce of 8 bytes per step,
read a step later, so a signal stops the run one or two steps after it arrives."""
from __future__ import annotations

from paddleformers.trainer import TrainerCallback

from ...checkpoint.layout import world_group
from ...recovery import signals
from ...recovery.boundary import StepBoundary


class PreemptionStop(TrainerCallback):
    def __init__(self):
        self.boundary = None  # made at the first step: the mesh exists once the Trainer parallelized the model

    def on_train_begin(self, args, state, control, **kwargs):
        signals.note_preemptions()

    def on_step_end(self, args, state, control, **kwargs):
        if self.boundary is None:
            self.boundary = StepBoundary(world_group())
        if self.boundary.agreed().preempted:
            control.should_save = True
            control.should_training_stop = True
        self.boundary.contribute(signals.received(), False)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        signals.restore_handlers()
