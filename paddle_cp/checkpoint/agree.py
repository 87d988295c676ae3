"""Ranks agreeing before and after a checkpoint's data moves: one small collective each, so
every rank raises the same error or none does."""
from __future__ import annotations

import numpy as np
import paddle

from ..comm import collectives


def same_everywhere(group, description):
    """The same ValueError on every rank unless every rank passed the same arguments (path, the
    model's keys, global shapes and dtypes, the optimizer): one all-gather of a digest, before any data."""
    if group is None:
        return
    digests = collectives.gathered_digests(group, repr(description).encode(), tag="checkpoint_agree")
    if len(set(digests)) > 1:
        ranks = {}
        for rank, value in zip(group.ranks, digests):
            ranks.setdefault(value, []).append(rank)
        raise ValueError(f"ranks disagree on the checkpoint call (path, model keys, global shapes or dtypes, "
                         f"optimizer): the ranks agreeing with each other are {sorted(ranks.values())}; build the "
                         "same model and optimizer and pass the same path on every rank")


def count_failures(group, ok, tag):
    """Number of ranks that report failure (every rank calls it: also a barrier)."""
    flag = paddle.to_tensor(np.array([0 if ok else 1], dtype="int32"))
    if group is not None:
        collectives.all_reduce(group, flag, tag=tag)
    return int(flag.numpy()[0])
