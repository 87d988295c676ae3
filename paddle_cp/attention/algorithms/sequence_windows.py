"""Each run of consecutive global positions a rank holds, widened by the tokens just before and after it:
what a convolution over a sequence split in any layout needs.

A run covering global positions [a, e) needs [a - before, e + after); positions outside [0, seq_len)
are zeros (the convolution's zero padding), the others belong to this rank or another. Runs are
maximal, so a position within `before` of a run's start is among the last `before` tokens of the run
holding it, and one within `after` of a run's end among the first `after` of its run: each rank shares
just those edge tokens of its runs, in one all-gather whose backward returns to every rank the sum of
the gradients all ranks took from its edges (comm.autograd.gather_summed). A run may be shorter than
`before` (a short sequence over many ranks): a window then takes tokens from several runs and ranks.
A neighbour halo exchange (comm/halo.py) moves fewer bytes, but only when every rank holds one run, in
rank order, at least as long as the halo; the p2p layout gives each rank two runs and the per-document
layout any number, so the all-gather of edges (before + after tokens per run, a few tokens) serves all.
"""
from __future__ import annotations

import numpy as np
import paddle

from ...comm.autograd import gather_summed
from ..layout.sequence_layout import runs


def _edges(positions, before, after):
    """Local indices of the tokens a rank shares: the last `before` and the first `after` of each run."""
    shared = set()
    for a, e in runs(positions):
        shared.update(range(max(a, e - before), e))
        shared.update(range(a, min(e, a + after)))
    return np.array(sorted(shared), dtype=np.int64)


class RunWindows:
    """This rank's runs (positions[index]) of a sequence whose ranks hold `every_positions`, widened."""

    def __init__(self, every_positions, index, seq_len, before, after):
        mine = every_positions[index]
        self.before, self.after = before, after
        self.runs = runs(mine)
        edges = [_edges(p, before, after) for p in every_positions]
        self.edge_counts = [len(e) for e in edges]
        self.own_edges = paddle.to_tensor(edges[index])
        shared = np.concatenate([p[e] for p, e in zip(every_positions, edges)])  # gathered order
        row_of = {int(position): row for row, position in enumerate(shared)}
        table, zero = len(shared), len(shared) + len(mine)  # source = [shared edges | local tokens | a zero]

        def source_rows(positions):
            return [zero if q < 0 or q >= seq_len else row_of[q] for q in positions]

        pieces = []
        for a, e in self.runs:
            start, end = int(mine[a]), int(mine[e - 1]) + 1
            pieces += [source_rows(range(start - before, start)), np.arange(table + a, table + e),
                       source_rows(range(end, end + after))]
        self.index = paddle.to_tensor(np.concatenate(pieces).astype(np.int64))
        keep, offset = [], 0  # each window's outputs before, before+1, ...: one per token of its run
        for a, e in self.runs:
            keep.append(np.arange(offset + before, offset + before + e - a))
            offset += before + e - a + after
        self.keep = paddle.to_tensor(np.concatenate(keep).astype(np.int64))

    def widen(self, x, axis, group):
        """[.., s_local, ..] -> [.., sum of (before + run + after), ..]: the runs' windows in local order."""
        if self.before == self.after == 0:
            return x
        edges = paddle.index_select(x, self.own_edges, axis=axis)
        shared = gather_summed(edges, group, axis, self.edge_counts, tag="sequence_halo")  # [.., all edges, ..]
        zero_shape = list(x.shape)
        zero_shape[axis] = 1
        source = paddle.concat([shared, x, paddle.zeros(zero_shape, x.dtype)], axis=axis)
        return paddle.index_select(source, self.index, axis=axis)

    def narrow(self, y, axis):
        """Each window's outputs `before`, before+1, ... (one per token of its run) -> [.., s_local, ..]."""
        if self.before == self.after == 0:
            return y
        return paddle.index_select(y, self.keep, axis=axis)


def run_windows(layout, seq_len, index, before, after):
    """The RunWindows of rank `index` of `layout` (a SequenceLayout) for a `seq_len`-token sequence, kept
    by the layout (a plan's for its batches without documents, a batch's own for its documents)."""
    key = (seq_len, index, before, after)
    if key not in layout.windows:
        every = [layout.positions(seq_len, r) for r in range(layout.world)]
        layout.windows[key] = RunWindows(every, index, seq_len, before, after)
    return layout.windows[key]
