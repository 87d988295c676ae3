"""`Resumable`: a training loop that a killed rank, a restart or a preemption costs at most one checkpoint interval.

    with pcp.Resumable("ckpt", model, optimizer, save_every=10, objects={"lr": scheduler}) as run:
        for step in run.steps(total):          # from the last committed checkpoint on
            ...                                # the step: forward, backward, optimizer.step()
            run.extra["losses"].append(loss)   # JSON kept with every checkpoint

Entering: the job's attempt history is read (attempts.py: a crash loop stops the job here, with one message),
then the newest committed checkpoint under `root` is loaded onto the current mesh and plans, with every rank's
random generators and the named objects' state (rank_state.py); a partial save is never picked. Each step
boundary: one all-reduce of one int64 (boundary.py) tells every rank, a step late, whether any rank received
SIGTERM/SIGUSR1 and whether any is still writing the async save; a save published, a checkpoint every
`save_every` steps written in the background (`checkpoint-<steps done>`), the oldest pruned beyond `keep_latest`.
A preemption agreed: a checkpoint saved and committed at once, `steps()` ends, `run.preempted` counts the ranks signalled;
the script then exits 0, which Paddle's launch takes for a finished job (not restarted). A step that raises: its
step and error recorded for the crash-loop rule, then raised as it was (the launch restarts the job).
"""
from __future__ import annotations

import json
import os
import shutil

import paddle
import paddle.distributed as dist

from .. import checkpoint, runtime
from ..checkpoint import commit, layout
from . import attempts, rank_state, signals
from .boundary import StepBoundary

PREFIX = "checkpoint-"
IMPLICIT_SCHEDULER = "optimizer_lr_scheduler"  # the optimizer's LR scheduler, resumed without being named


def _check(root, save_every, keep_latest, objects, extra, tries_per_step, async_save, fresh):
    if not isinstance(root, (str, os.PathLike)) or not str(root):
        raise TypeError(f"Resumable(root) takes the folder of the run's checkpoints, got {root!r}")
    for name, value, least in (("save_every", save_every, 0), ("tries_per_step", tries_per_step, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"Resumable({name}=...) takes a whole number >= {least}, got {value!r}")
    if keep_latest is not None and (isinstance(keep_latest, bool) or not isinstance(keep_latest, int)
                                    or keep_latest < 1):
        raise ValueError(f"Resumable(keep_latest=...) takes a whole number >= 1 (or None: keep all), got "
                         f"{keep_latest!r}")
    if not isinstance(objects, dict) or any(not (hasattr(obj, "state_dict") and hasattr(obj, "set_state_dict"))
                                            for obj in objects.values()):
        raise TypeError("Resumable(objects=...) takes {name: object with state_dict() and set_state_dict()} "
                        f"(an LR scheduler, a GradScaler, a sampler), got {objects!r}")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Resumable(extra=...) must be JSON-serializable: {exc}") from exc
    for name, value in (("async_save", async_save), ("fresh", fresh)):
        if not isinstance(value, bool):
            raise TypeError(f"Resumable({name}=...) takes True or False, got {value!r}")


class Resumable:
    def __init__(self, root, model, optimizer=None, *, save_every, keep_latest=3, objects=None, extra=None,
                 async_save=True, tries_per_step=3, fresh=False):
        """`root`: this run's checkpoints (`checkpoint-<n>`) and attempt history; `save_every`: steps between
        checkpoints (0: only when preempted and at the end); `keep_latest`: committed checkpoints kept (None: all);
        `objects`: {name: anything with state_dict()/set_state_dict()} resumed per rank (the optimizer's learning
        rate scheduler is one without being named: a resumed run would start its warm-up again); `extra`: the JSON
        state the run keeps in `run.extra` (replaced by the checkpoint's when resuming); `tries_per_step`: attempts
        that may fail at one step before the job stops (0: any number); `fresh`: remove what `root` holds and start
        at step 0."""
        objects = {} if objects is None else objects
        extra = {} if extra is None else extra
        _check(root, save_every, keep_latest, objects, extra, tries_per_step, async_save, fresh)
        scheduler = getattr(optimizer, "_learning_rate", None)
        if isinstance(scheduler, paddle.optimizer.lr.LRScheduler) and all(o is not scheduler for o in objects.values()):
            objects = {**objects, IMPLICIT_SCHEDULER: scheduler}
        self.root, self.model, self.optimizer = str(root), model, optimizer
        self.save_every, self.keep_latest, self.objects = save_every, keep_latest, objects
        self.extra, self.async_save, self.tries_per_step, self.fresh = extra, async_save, tries_per_step, fresh
        self.step = 0  # steps done
        self.resumed_from = None  # the checkpoint this attempt started from
        self.preempted = 0  # once a preemption stopped the run: how many ranks received a signal
        self.attempt = None
        self._running_step = None  # the step being run (numbered from 1), for a failure's record
        self._saved_step = None  # steps done at the last save this attempt started
        self._group = None
        self._boundary = None

    # ---- entering: history, crash loop, resume ----------------------------------------------------------------
    def __enter__(self):
        self._group = layout.world_group()
        rank, world = dist.get_rank(), dist.get_world_size()
        if self.fresh and rank == 0:
            shutil.rmtree(self.root, ignore_errors=True)  # enter's forget waits for it on every rank
        self.attempt = attempts.enter(self.root, self.tries_per_step, self._group, forget=self.fresh)
        latest = commit.latest_checkpoint(self.root)
        if latest is not None:
            saved = checkpoint.load_checkpoint(latest, self.model, self.optimizer)
            if not isinstance(saved, dict) or "step" not in saved or not os.path.isdir(
                    os.path.join(latest, rank_state.FOLDER)):
                raise ValueError(f"{latest} was not saved by pcp.Resumable (no step or rank state in it): give "
                                 "Resumable a root of its own, or fresh=True to start over there")
            self.step, self.extra = saved["step"], saved.get("extra", self.extra)
            # a checkpoint of a run that named no scheduler before Resumable kept it unasked holds none
            taken = rank_state.restore(latest, rank, world, self.objects, optional=(IMPLICIT_SCHEDULER,))
            self.resumed_from, self._saved_step = latest, self.step
            if rank == 0:
                ranks = "each rank its own" if taken == rank else "rank 0's on every rank (another world size)"
                print(f"paddle_cp: resumed from {latest} after step {self.step} (attempt {self.attempt}; random "
                      f"generators and {sorted(self.objects) or 'no objects'}: {ranks})", flush=True)
        if rank == 0:
            attempts.start_attempt(self.root, self.attempt, self.step, world)
        signals.note_preemptions()
        self._boundary = StepBoundary(self._group)
        return self

    # ---- the loop ---------------------------------------------------------------------------------------------
    def steps(self, total):
        """The indices (from 0) of the steps still to run up to `total`, each followed by its step boundary."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"Resumable.steps(total) takes the run's number of steps (>= 0), got {total!r}")
        if self._boundary is None:
            raise RuntimeError("Resumable.steps() runs inside `with Resumable(...) as run:`")
        while self.step < total:
            self._running_step = self.step + 1
            yield self.step
            self.step += 1
            if self._at_boundary(total):
                return
        self._save(async_save=False)  # the end: committed before steps() returns (nothing if saved just now)

    def _at_boundary(self, total):
        """True once a preemption is agreed (saved; the run stops)."""
        agreed = self._boundary.agreed()
        pending = runtime.state.pending_save
        if pending is not None and agreed.writing == 0:
            checkpoint.wait_checkpoint()  # every rank's files were written a step ago: publish (collective)
            self._prune()
        if agreed.preempted:
            self.preempted = agreed.preempted
            self._save(async_save=False)
            if dist.get_rank() == 0:
                print(f"paddle_cp: a preemption signal reached {agreed.preempted} rank(s): saved "
                      f"{self._path(self.step)} after step {self.step}; stopping", flush=True)
            return True
        if self.save_every and self.step % self.save_every == 0 and self.step < total:
            self._save(self.async_save)
        pending = runtime.state.pending_save
        self._boundary.contribute(signals.received(), pending is not None and pending.thread.is_alive())
        return False

    # ---- saving ---------------------------------------------------------------------------------------------
    def _path(self, step):
        return os.path.join(self.root, f"{PREFIX}{step}")

    def _save(self, async_save):
        if self._saved_step != self.step:
            rank, world = dist.get_rank(), dist.get_world_size()
            checkpoint.save_checkpoint(self._path(self.step), self.model, self.optimizer,
                                       extra={"step": self.step, "extra": self.extra}, async_save=async_save,
                                       rank_files=lambda directory: rank_state.write(directory, rank, world,
                                                                                     self.objects))
            self._saved_step = self.step
        if not async_save:
            checkpoint.wait_checkpoint()
        self._prune()

    def _prune(self):
        if self.keep_latest is not None and dist.get_rank() == 0:
            commit.prune_checkpoints(self.root, self.keep_latest)

    # ---- leaving ---------------------------------------------------------------------------------------------
    def __exit__(self, kind, exc, traceback):
        signals.restore_handlers()
        if exc is None:
            checkpoint.wait_checkpoint()  # a loop left early: its last save published
        elif isinstance(exc, Exception):
            step = self._running_step if self._running_step is not None else self.step + 1
            attempts.record_failure(self.root, self.attempt, dist.get_rank(), step, exc)
            self._abandon_pending_save()
        return False

    @staticmethod
    def _abandon_pending_save():
        """A failed run's async save is never published (that takes every rank, some may be gone): its files stay
        in `<path>.partial`, which the next save of that path clears."""
        pending, runtime.state.pending_save = runtime.state.pending_save, None
        if pending is not None and pending.thread.ident is not None:
            pending.thread.join()

