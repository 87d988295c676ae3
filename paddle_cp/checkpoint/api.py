"""`save_checkpoint`, `load_checkpoint`, `wait_checkpoint`: collective, arguments checked on every
rank before any data moves."""
from __future__ import annotations

import json
import os
import threading

import paddle
import paddle.distributed as dist

from .. import runtime
from . import commit, layout, restore, shards
from .agree import count_failures, same_everywhere
from .format import MODEL_DIR, OPTIMIZER_DIR, BoxReader, global_specs, merge_metadata, read_metadata, write_state



def _check_common(path, model, optimizer):
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"checkpoint path must be a non-empty str or os.PathLike, got {path!r}")
    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"model must be a paddle.nn.Layer, got {type(model).__name__}")
    if optimizer is not None:
        layout.accumulator_names(optimizer)


def _check_save(path, model, optimizer, extra, async_save, rank_files):
    _check_common(path, model, optimizer)
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save must be True or False, got {async_save!r}")
    if rank_files is not None and not callable(rank_files):
        raise TypeError(f"rank_files must be a function of the directory being written, got {rank_files!r}")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"extra must be JSON-serializable (numbers, strings, lists, dicts): {exc}; "
                        "convert tensors and arrays with .tolist()") from exc
    if os.path.exists(path):
        raise ValueError(f"checkpoint path {path} exists already: save each checkpoint to a new path "
                         "(e.g. root/checkpoint-<step>) or delete the old one first")


def _call_description(path, model, optimizer):
    names = None if optimizer is None else layout.accumulator_names(optimizer)
    return os.path.abspath(path), sorted(restore.expected_model_specs(model).items()), names


class _Save:
    """One save's file writing (in a background thread when async) and its publication."""

    def __init__(self, path, extra, states, group, async_save, rank_files):
        """`states`: {folder: [(key, SavedBox)]}, this rank's own boxes, copied to the host now when async
        (training goes on while the thread writes), else one file's worth at a time while writing.
        `rank_files(directory)`: this rank's own files, written now (their state as of this call)."""
        self.path, self.extra, self.group, self.copied = path, extra, group, async_save
        self.error = None
        if rank_files is not None:
            try:
                os.makedirs(commit.partial_path(path), exist_ok=True)
                rank_files(commit.partial_path(path))
            except Exception as exc:  # noqa: BLE001 - reported to every rank in finish()
                self.error = exc
        self.jobs = []
        for folder, boxes in states.items():
            files = shards.files_of(boxes)
            if async_save:
                for box in (box for _, box in boxes):
                    box.take(copy=True)
            self.jobs.append((os.path.join(commit.partial_path(path), folder), files))
        self.has_optimizer = OPTIMIZER_DIR in states
        self.thread = threading.Thread(target=self._write, name="paddle_cp-checkpoint-writer", daemon=True)
        if async_save:
            self.thread.start()
        else:
            self._write()

    def _write(self):
        if self.error is not None:
            return
        try:
            for directory, files in self.jobs:
                write_state(directory, files, self.copied)
        except Exception as exc:  # noqa: BLE001 - reported to every rank in finish()
            self.error = exc

    def finish(self):
        """Every rank reports; all succeeded: the coordinator publishes; else all raise."""
        if self.thread.ident is not None:  # started: async
            self.thread.join()
        failed = count_failures(self.group, self.error is None, "checkpoint_written")
        if failed:
            if dist.get_rank() == 0:
                commit.clear_partial(self.path)
            count_failures(self.group, True, "checkpoint_cleared")  # gone for every rank when the error arrives
            raise RuntimeError(f"saving checkpoint {self.path} failed on {failed} rank(s) (the cause is chained "
                               "on those ranks): it was not published; the previous checkpoint is still the "
                               "latest") from self.error
        error = None
        if dist.get_rank() == 0:
            try:
                for directory, _ in self.jobs:  # every rank's index is written: the metadata of all boxes
                    merge_metadata(directory)
                commit.publish(self.path, self.extra, self.has_optimizer)
            except OSError as exc:  # e.g. the path appeared meanwhile: every rank must hear of it
                error = exc
        if count_failures(self.group, error is None, "checkpoint_published"):  # also: visible to every rank on return
            raise RuntimeError(f"publishing checkpoint {self.path} failed on rank 0 (the cause is chained there); "
                               f"its files stay in {commit.partial_path(self.path)}") from error


def wait_checkpoint():
    """Finish an async save (collective): returns once it is published, raises on every rank if it failed."""
    save, runtime.state.pending_save = runtime.state.pending_save, None
    if save is not None:
        save.finish()


def save_checkpoint(path, model, optimizer=None, extra=None, async_save=False, rank_files=None):
    """Save `model` (and `optimizer`'s state, and JSON-able `extra`) to the new directory `path`.
    `rank_files(directory)`: called on every rank to write that rank's own files into the checkpoint before
    it is committed (state only it holds: RNG, a data loader's position; names must differ between ranks)."""
    wait_checkpoint()  # first: the pending save may be publishing `path`
    _check_save(path, model, optimizer, extra, async_save, rank_files)
    group = layout.world_group()
    if dist.get_rank() == 0:
        commit.clear_partial(path)
    # also a barrier: no rank writes before a stale partial save is gone
    same_everywhere(group, (_call_description(path, model, optimizer), extra, async_save))
    states = {MODEL_DIR: shards.model_boxes(model)}  # this rank's own boxes: no data moves between ranks
    if optimizer is not None:
        states[OPTIMIZER_DIR] = shards.optimizer_boxes(model, optimizer)
    # a copy as of this call: an async save publishes `extra` later, when the caller may have changed it
    save = _Save(path, json.loads(json.dumps(extra)), states, group, async_save, rank_files)
    if async_save:
        runtime.state.pending_save = save
    else:
        save.finish()


# (saved, wanted) dtypes a load converts: an fp32 run's checkpoint into a model paddle.amp.decorate cast to
# bfloat16/float16 (O2). The parameters are rounded to the model's dtype; with multi_precision the saved fp32
# values become the master weights exactly (restore.restore_optimizer).
CASTS = {("float32", "bfloat16"), ("float32", "float16")}


def _check_specs(found, wanted, what, path, allow_missing=False):
    """Same keys (checkpoint keys a subset when allow_missing), global shapes and dtypes, else ValueError."""
    unexpected = sorted(set(found) - set(wanted))
    missing = [] if allow_missing else sorted(set(wanted) - set(found))
    if unexpected or missing:
        raise ValueError(f"checkpoint {path} does not fit this {what}: keys only in the checkpoint "
                         f"{unexpected[:5]}, keys it lacks {missing[:5]}; build the same model (and optimizer) "
                         "that saved it")
    for key, (shape, dtype) in sorted(found.items()):
        if tuple(wanted[key][0]) != tuple(shape) or wanted[key][1] != dtype and (dtype, wanted[key][1]) not in CASTS:
            raise ValueError(f"checkpoint {path} holds '{key}' as {dtype}{list(shape)}, this {what} needs "
                             f"{wanted[key][1]}{list(wanted[key][0])}: build the model with the config that "
                             "saved it (or cast after loading)")


def load_checkpoint(path, model, optimizer=None):
    """Restore `model` (and `optimizer`) from `path` onto the current mesh and plans; returns `extra`."""
    _check_common(path, model, optimizer)
    wait_checkpoint()
    same_everywhere(layout.world_group(), _call_description(path, model, optimizer))
    with commit.reading(path):  # not pruned while this rank reads it
        return _load(path, model, optimizer)


def _load(path, model, optimizer):
    marker = commit.read_marker(path)
    model_dir = os.path.join(path, MODEL_DIR)
    model_meta = read_metadata(model_dir)
    _check_specs(global_specs(model_meta), restore.expected_model_specs(model), "model", path)
    optimizer_meta = None
    if optimizer is not None and marker["has_optimizer"]:
        optimizer_meta = read_metadata(os.path.join(path, OPTIMIZER_DIR))
        _check_specs(global_specs(optimizer_meta), restore.expected_optimizer_specs(model, optimizer),
                     "optimizer", path, allow_missing=True)
    model_reader = BoxReader(model_dir, model_meta)
    restore.restore_model(model, model_reader)
    if optimizer_meta is not None:
        restore.restore_optimizer(model, optimizer, BoxReader(os.path.join(path, OPTIMIZER_DIR), optimizer_meta),
                                  model_reader)
    return marker["extra"]
