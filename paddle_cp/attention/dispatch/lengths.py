"""The global sequence length agreed from the lengths the ranks hold (one tiny all-gather).

Used where a rank cannot know the others' shards (unsharding, the functional
attention without `seq_len`): every rank sees the same list, so a split that
does not form the layout raises the same error everywhere and none waits.
"""
from __future__ import annotations

import paddle

from ...comm import collectives


def held_lengths(length, group):
    """Every rank's length along the sequence dim (one all-gather of one int)."""
    if group.size == 1:
        return [length]
    parts = collectives.all_gather(group, paddle.to_tensor([length], dtype="int64"), tag="seq_lengths")
    return [int(p.item()) for p in parts]


def agreed_seq_len(layout, group, length, seq_len=None, dim=1):
    """`seq_len` (default: the sum of the held lengths), checked against every rank's length."""
    held = held_lengths(length, group)
    seq_len = seq_len or sum(held)
    layout.check_length(seq_len)
    lengths = layout.lengths(seq_len)
    if lengths != held:
        raise ValueError(
            f"the ranks hold {held} tokens along dim {dim}, but a {seq_len}-token sequence in the "
            f"{layout.backend!r} layout is split {lengths}: shard with PrepareContextParallel or "
            "paddle_cp.shard_sequence, and pass the seq_len and backend the tensor was sharded with"
        )
    return seq_len
