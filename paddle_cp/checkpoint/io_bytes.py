"""Bytes this process read from and wrote to checkpoint and pretrained-weight files: what
`pcp-memory` and the tests report per rank (the data asked for, not the file system's pages)."""
from __future__ import annotations

_counts = {"read": 0, "written": 0}


def count(kind, nbytes):
    _counts[kind] += int(nbytes)


def io_bytes():
    """{"read": bytes, "written": bytes} since the last reset_io_bytes()."""
    return dict(_counts)


def reset_io_bytes():
    for kind in _counts:
        _counts[kind] = 0
