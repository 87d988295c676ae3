"""Bytes this process read from and wrote to checkpoint and pretrained-weight files: what
`pcp-memory` and the tests report per rank (the data asked for, not the file system's pages)."""
from __future__ import annotations

from ..runtime import state


def count(kind, nbytes):
    state.io_bytes[kind] += int(nbytes)


def io_bytes():
    """{"read": bytes, "written": bytes} since the last reset_io_bytes() (or runtime.reset())."""
    return dict(state.io_bytes)


def reset_io_bytes():
    for kind in state.io_bytes:
        state.io_bytes[kind] = 0
