"""Host reads: the calls that make the host wait for a device value, counted while a block of code runs.

On a GPU every read of a device value on the host (`.numpy()`, `.item()`, `.tolist()`, `float()`,
`int()`, `bool()`, an index) drains the queue of kernels and collectives the host had run ahead
with; `paddle.to_tensor` of host data copies in the other direction, once per call, in the hot path.
Both are counted here (a read made by a read counts once), each by the line outside Paddle
(paddle_cp's, the model's or the script's) that made it, so a count of 0 says a step never waits
for the device and a count above 0 says where it did. A read of a value gathered a step earlier (comm/deferred.py), which waits at
most for that earlier collective, is counted apart as `deferred`.
On CPU these calls cost nothing; what is counted is what a GPU run would do.
Used by the tests (tests/workers/host_syncs.py, host_reads_step.py) and by pcp-bench.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import paddle

from ..comm.deferred import DeferredRead

READS = ("numpy", "item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__array__")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HERE = os.path.abspath(__file__)


@dataclass
class HostReads:
    reads: int = 0  # device values read on the host
    uploads: int = 0  # paddle.to_tensor of host data
    deferred: int = 0  # values gathered a step earlier, read now
    sites: Counter = field(default_factory=Counter)  # "kind at file:line" -> calls
    within: Counter = field(default_factory=Counter)  # path prefix -> calls made with a frame under it on the stack

    def as_dict(self):
        return {"reads": self.reads, "uploads": self.uploads, "deferred": self.deferred, "sites": dict(self.sites),
                "within": dict(self.within)}

    def total(self):
        """What stalls a GPU step: reads and uploads (deferred reads do not wait for this step's work)."""
        return self.reads + self.uploads


def _site():
    """file:line of the innermost caller outside Paddle (paddle_cp's, the model's, the script's): where the
    read was made."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and f"{os.sep}paddle{os.sep}" not in path:
            if path.startswith(_PACKAGE):
                return f"{os.path.relpath(path, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"
            return f"{path.rpartition('site-packages' + os.sep)[2]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _callers(prefixes):
    """The `prefixes` (paths from the package's parent, e.g. "paddle_cp/data_parallel/") that a frame on the
    stack lies under: a read made in comm/ or pipeline/ on behalf of data_parallel/ counts for it too."""
    found, frame = set(), sys._getframe(2)
    while frame is not None and len(found) < len(prefixes):
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_PACKAGE):
            found.update(p for p in prefixes if os.path.relpath(path, os.path.dirname(_PACKAGE)).startswith(p))
        frame = frame.f_back
    return found


@contextlib.contextmanager
def counting(counts=None, within=()):
    """Count host reads while the block runs: `with counting() as counts: ...` (a HostReads); `within`: path
    prefixes whose calls on the stack are counted in `counts.within` as well."""
    counts = HostReads() if counts is None else counts
    depth = [0]  # reads made by a read (numpy inside tolist, ...) count once

    def wrapped(kind, original, counted):
        def call(*args, **kwargs):
            if depth[0] == 0 and counted(args):
                setattr(counts, kind, getattr(counts, kind) + 1)
                counts.sites[f"{kind} at {_site()}"] += 1
                counts.within.update(_callers(within))
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    def from_host(args):
        return bool(args) and not isinstance(args[0], paddle.Tensor)

    patched = [(paddle.Tensor, name, wrapped("reads", getattr(paddle.Tensor, name), lambda args: True))
               for name in READS if hasattr(paddle.Tensor, name)]
    patched.append((paddle, "to_tensor", wrapped("uploads", paddle.to_tensor, from_host)))
    patched.append((DeferredRead, "result", wrapped("deferred", DeferredRead.result, lambda args: True)))
    originals = [(owner, name, owner.__dict__.get(name, getattr(owner, name))) for owner, name, _ in patched]
    for owner, name, replacement in patched:
        setattr(owner, name, replacement)
    try:
        yield counts
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
