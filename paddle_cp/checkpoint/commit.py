"""A checkpoint becomes visible only when complete.

Ranks write into `<path>.partial`; once every rank reports its files written, the
coordinator writes the marker (every file and its size, the extra state) and
renames the directory to `<path>` in one atomic step. A rank that dies mid-save
leaves only a `.partial` directory, which `latest_checkpoint` ignores and the
next save of that path clears. Loading checks the marker's file list and sizes,
so truncated or missing files fail before any tensor is read.

Old checkpoints are pruned (`prune_checkpoints`, keep the newest k) by renaming each to
`<path>.pruning` first, so no reader ever finds half of one, and never while it is being read:
`reading(path)` holds a shared lock on its marker for as long as a load reads it, and pruning
skips a checkpoint whose marker it cannot lock exclusively at once.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time

MARKER = "pcp_checkpoint.json"
PARTIAL = ".partial"
PRUNING = ".pruning"


def partial_path(path):
    return os.path.normpath(path) + PARTIAL


def clear_partial(path):
    """Remove a save that never completed (coordinator only)."""
    shutil.rmtree(partial_path(path), ignore_errors=True)


def _file_sizes(directory):
    sizes = {}
    for folder, _, files in os.walk(directory):
        for name in files:
            full = os.path.join(folder, name)
            sizes[os.path.relpath(full, directory)] = os.path.getsize(full)
    return sizes


def publish(path, extra, has_optimizer):
    """Write the marker into the finished partial directory, then rename it to `path` (coordinator only)."""
    partial = partial_path(path)
    marker = {"files": _file_sizes(partial), "extra": extra, "has_optimizer": has_optimizer,
              "saved_at": time.time()}
    with open(os.path.join(partial, MARKER), "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(partial, os.path.normpath(path))


def read_marker(path):
    """The marker of a complete checkpoint, after checking every file it lists is there, whole."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint path must be a str or os.PathLike, got {type(path).__name__}")
    marker_file = os.path.join(path, MARKER)
    if not os.path.isfile(marker_file):
        hint = "it does not exist" if not os.path.exists(path) else f"it has no {MARKER} (an unfinished save?)"
        raise ValueError(f"{path} is not a complete paddle_cp checkpoint: {hint}; "
                         "pass a path that pcp.latest_checkpoint(root) returns")
    try:
        with open(marker_file) as f:
            marker = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint marker {marker_file} is unreadable ({exc}): load an earlier checkpoint") from exc
    for name, size in marker["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint {path} is missing {name}: load an earlier checkpoint")
        if os.path.getsize(file) != size:
            raise ValueError(f"checkpoint file {file} has {os.path.getsize(file)} bytes, {size} were written "
                             "(truncated or overwritten): load an earlier checkpoint")
    return marker


def complete_checkpoints(root):
    """[(saved_at, path)] of the complete checkpoints directly under `root` (every file there, whole), oldest
    first; none for a folder that does not exist."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"latest_checkpoint(root) takes a directory path, got {type(root).__name__}")
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.endswith((PARTIAL, PRUNING)) or not os.path.isfile(os.path.join(path, MARKER)):
            continue
        try:
            found.append((read_marker(path)["saved_at"], path))
        except (ValueError, KeyError, OSError):
            continue  # missing or truncated files, or pruned by rank 0 during the scan: not one to resume from
    return sorted(found)


def latest_checkpoint(root):
    """The newest complete checkpoint directly under `root` (every file there, whole), or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


@contextlib.contextmanager
def reading(path):
    """Hold off pruning of the checkpoint `path` while the block reads it (a shared lock on its marker; any
    number of readers, in any process)."""
    try:
        marker = open(os.path.join(path, MARKER))
    except OSError:
        yield  # no marker: read_marker says what is wrong
        return
    with marker:
        fcntl.flock(marker, fcntl.LOCK_SH)
        yield


def prune_checkpoints(root, keep_latest):
    """Remove the complete checkpoints under `root` but the newest `keep_latest`, skipping any a reader holds
    (coordinator only); returns the paths removed."""
    removed = []
    for _, path in complete_checkpoints(root)[:-keep_latest]:
        with open(os.path.join(path, MARKER)) as marker:
            try:
                fcntl.flock(marker, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being read: the next save prunes it
            doomed = os.path.normpath(path) + PRUNING
            os.rename(path, doomed)  # under the lock: a reader that opens the marker next finds no checkpoint
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed
