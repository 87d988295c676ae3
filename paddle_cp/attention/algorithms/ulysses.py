"""Ulysses (all-to-all) over a group of U ranks: trade the sequence split for a head split.

[b, s_u, h, d] on each rank -> [b, s_group, h_u, d]: every rank gets the whole
group's sequence for its own heads, computes, and trades back. Head counts
need not divide: ranks get contiguous head ranges differing by at most one
k/v head. When there are fewer k/v heads than ranks, each is repeated in place
(the smallest repeat dividing the GQA group size) so every rank gets one.
"""
from __future__ import annotations

from dataclasses import dataclass

import paddle

from ...comm import collectives
from ...comm.autograd import all_to_all
from ..layout.sequence_layout import even_sizes


@dataclass(frozen=True)
class HeadSplit:
    repeat: int  # each k/v head repeated this many times, in place
    kv_counts: list  # k/v heads (after repeating) per rank
    group_size: int  # q heads per (repeated) k/v head

    @property
    def q_counts(self):
        return [c * self.group_size for c in self.kv_counts]


def head_split(q_heads, kv_heads, ranks):
    if q_heads < ranks:
        raise ValueError(
            f"Ulysses splits heads over ranks: {q_heads} query heads cannot cover {ranks} ranks; "
            f"use ulysses_degree <= {q_heads} (backend='hybrid') or backend='p2p'"
        )
    group = q_heads // kv_heads
    repeat = next(t for t in range(1, group + 1) if group % t == 0 and kv_heads * t >= ranks)
    return HeadSplit(repeat, even_sizes(kv_heads * repeat, ranks), group // repeat)


def repeat_kv_heads(x, times):
    """[b, s, h, d] -> [b, s, h*times, d], each head repeated in place (Paddle's GQA order)."""
    if times == 1:
        return x
    b, s, h, d = x.shape
    return x.unsqueeze(3).expand([b, s, h, times, d]).reshape([b, s, h * times, d])


def to_heads(x, group, head_counts, lengths):
    """[b, s_u, h, ...] -> [b, s_group, h_u, ...]: the group's whole sequence for this rank's heads
    (`head_counts[j]`: heads of member j; `lengths[j]`: tokens member j holds)."""
    return all_to_all(x, group, 2, 1, head_counts, lengths, tag="ulysses")


def to_sequence(x, group, head_counts, lengths):
    """[b, s_group, h_u, ...] -> [b, s_u, h, ...]: the trade back."""
    return all_to_all(x, group, 1, 2, lengths, head_counts, tag="ulysses")


def scatter_heads(q, k, v, group, split, lengths):
    """Local [b, s_u, h, d] -> [b, s_group, h_u, d] (`lengths`: s of each group member)."""
    k, v = repeat_kv_heads(k, split.repeat), repeat_kv_heads(v, split.repeat)
    q = to_heads(q, group, split.q_counts, lengths)
    k, v = (to_heads(x, group, split.kv_counts, lengths) for x in (k, v))
    return q, k, v


def gather_heads(out, group, split, lengths):
    return to_sequence(out, group, split.q_counts, lengths)


def gather_mask_rows(dense, group, split, lengths, q_heads):
    """This rank's view of a dense mask after the trade: the group's rows, its heads."""
    width = max(lengths)
    as_bytes = dense.dtype == paddle.bool  # gloo gathers no bool tensors
    rows = dense.astype("uint8") if as_bytes else dense
    if rows.shape[2] < width:
        pad = paddle.zeros([*rows.shape[:2], width - rows.shape[2], rows.shape[3]], rows.dtype)
        rows = paddle.concat([rows, pad], axis=2)
    parts = collectives.all_gather(group, rows, tag="ulysses_mask")
    rows = paddle.concat([p[:, :, :n] for p, n in zip(parts, lengths)], axis=2)
    if as_bytes:
        rows = rows.astype(paddle.bool)
    if rows.shape[1] == q_heads:
        start = sum(split.q_counts[: group.index])
        rows = rows[:, start:start + split.q_counts[group.index]]
    return rows
