"""Every rank of a `sep` group must pass the same full batch: PrepareContextParallel splits
it, each rank keeping its part of one sequence. Ranks that each draw their own batch (a
data-parallel habit) would train silently wrong, so every forward checks.

Cost: an exact integer fingerprint of each input it splits, on the device (comm/
fingerprint.py); one all-gather of SLOTS + 3 int64 per rank over the sep group; one
host read of the gathered rows. A recomputed forward (Paddle's recompute around the
whole model) replays the check without gathering again.
"""
from __future__ import annotations

import contextlib
import zlib

import paddle

from .. import runtime
from ..attention import recompute
from ..comm import collectives
from ..comm.fingerprint import fingerprint

SLOTS = 4  # value fingerprints per rank: inputs in name order share slot i % SLOTS
TAG = "cp_batch_check"  # its bytes in paddle_cp.bytes_sent()


def check_same_batch(sep_group, inputs, batch, seq_len):
    """Raise the same ValueError on every rank of `sep_group` unless all of them passed equal
    `inputs` ({name: tensor}, the tensors to be split). Collective: every rank calls it."""
    if sep_group.size == 1:
        return
    memo = runtime.state.checked_batches[-1] if runtime.state.checked_batches else None
    if memo is not None and memo.get(id(sep_group)):
        return  # a recompute replay: checked in this forward already
    names = sorted(inputs)
    layout = repr([(name, list(inputs[name].shape), str(inputs[name].dtype)) for name in names])
    slots = [paddle.zeros([1], "int64") for _ in range(SLOTS)]
    for i, name in enumerate(names):
        slots[i % SLOTS] = slots[i % SLOTS] + fingerprint(inputs[name])
    mine = paddle.concat([paddle.to_tensor([zlib.crc32(layout.encode()), batch, seq_len], dtype="int64"), *slots])
    rows = paddle.stack(collectives.all_gather(sep_group, mine, tag=TAG)).numpy().tolist()
    if memo is not None:
        memo[id(sep_group)] = True
    _raise_unless_equal(rows, names)


def _raise_unless_equal(rows, names):
    first = rows[0]
    if all(row[0] == first[0] for row in rows):
        differ = sorted({name for row in rows for i, name in enumerate(names)
                         if row[3 + i % SLOTS] != first[3 + i % SLOTS]})
        if not differ:
            return
        ranks = [r for r, row in enumerate(rows) if row != first]
        raise ValueError(
            f"context parallel: the ranks of a sep group passed different values of {differ} (positions {ranks} "
            "differ from position 0). Every rank of a sep group must pass the same full batch, which "
            "PrepareContextParallel splits; give each data-parallel replica its own batch over a `dp` mesh dim "
            "(pcp.shard_dataloader / pcp.shard_batch) and the same batch to the ranks of its sep group")
    shapes = ", ".join(f"position {r}: batch {row[1]} x {row[2]} tokens" for r, row in enumerate(rows))
    raise ValueError(
        f"context parallel: the ranks of a sep group passed inputs of different names, shapes or dtypes ({shapes}). "
        "Every rank of a sep group must pass the same full batch, which PrepareContextParallel splits")


@contextlib.contextmanager
def _checking_once(memo):
    runtime.state.checked_batches.append(memo)
    try:
        yield
    finally:
        runtime.state.checked_batches.pop()


def _capture():
    """A recompute call made outside any batch (around a whole model) shares one memo between its
    forward and its replay; one made inside a model's forward cannot re-run that model's check."""
    if runtime.state.batches:
        return None
    memo = {}
    return lambda: _checking_once(memo)


recompute.carry(_capture)
