"""A checkpoint becomes visible only when complete.

Ranks write into `<path>.partial`; once every rank reports its files written, the
coordinator writes the marker (every file and its size, the extra state) and
renames the directory to `<path>` in one atomic step. A rank that dies mid-save
leaves only a `.partial` directory, which `latest_checkpoint` ignores and the
next save of that path clears. Loading checks the marker's file list and sizes,
so truncated or missing files fail before any tensor is read.
"""
from __future__ import annotations

import json
import os
import shutil
import time

MARKER = "pcp_checkpoint.json"
PARTIAL = ".partial"


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


def latest_checkpoint(root):
    """The newest complete checkpoint directly under `root` (every file there, whole), or None."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"latest_checkpoint(root) takes a directory path, got {type(root).__name__}")
    if not os.path.isdir(root):
        return None
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.endswith(PARTIAL) or not os.path.isfile(os.path.join(path, MARKER)):
            continue
        try:
            found.append((read_marker(path)["saved_at"], path))
        except (ValueError, KeyError):
            continue  # missing or truncated files: not a checkpoint to resume from
    return max(found)[1] if found else None
