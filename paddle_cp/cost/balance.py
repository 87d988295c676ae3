"""Equal query-key work per ring group for a batch of packed documents, no padding: the `pairs` candidate
of packed_layout.py (on a GPU it fragments tiles; the tile model decides when it wins).

The work of a query is the number of keys it sees (causal, inside its document), summed over the
batch's rows: one layout serves every row, since a rank's tensors are [b, s_local, ...]. Cut the
sequence wherever some row's work does not grow by exactly one from the previous position (one of
its documents starts there). Inside such a segment every row's work is linear in the position, so,
as for the chunk layout of one document, equal pieces r and 2R-1-r of the segment carry the same
work for every ring group r, and the same number of tokens; a query's keys in earlier segments are
split the same way, so each ring step is balanced too.

What equal pieces cannot hand out goes to the groups as whole runs, largest work first: a segment's
middle when its length is not a multiple of 2R, and segments shorter than 2R tokens (short
documents stay on one rank). Each run is fewer than 2R tokens, so groups end within a few tokens
and a small fraction of the work of their targets. On the rows an H200 measured, these groups' tiles are
what the H200 counted (tests/unit/test_tile_cost.py).
"""
from __future__ import annotations

import numpy as np



def segment_starts(work):
    """Positions where some row's work does not grow by one: [0, ...] (int64)."""
    breaks = np.flatnonzero((np.diff(work, axis=1) != 1).any(axis=0)) + 1
    return np.concatenate([[0], breaks]).astype(np.int64)


def balanced_groups(work, ring):
    """`work`: int64 [b, seq_len], the keys each query sees. -> ring group of every position (int64 [seq_len])."""
    work = np.asarray(work, dtype=np.int64)
    seq_len = work.shape[1]
    summed = work.sum(axis=0)
    starts = segment_starts(work)
    lengths = np.diff(np.append(starts, seq_len))
    cumulative = np.concatenate([[0], np.cumsum(summed)])
    target_work = max(cumulative[-1] / ring, 1.0)
    piece = lengths // (2 * ring)  # tokens of each of a segment's 2R equal pieces (0: too short to cut)

    # equal pieces: position at offset o of a segment of length L with pieces of p tokens
    segment = np.repeat(np.arange(len(starts)), lengths)
    offset = np.arange(seq_len) - starts[segment]
    length, size = lengths[segment], np.maximum(piece[segment], 1)
    front, back = offset < ring * piece[segment], offset >= length - ring * piece[segment]
    group = np.where(front, offset // size, np.where(back, (length - 1 - offset) // size, -1))

    # the rest, one run per segment: its middle, or all of it when uncut
    rest_start = starts + ring * piece
    rest_end = starts + lengths - ring * piece
    runs = np.flatnonzero(rest_end > rest_start)
    run_work = cumulative[rest_end[runs]] - cumulative[rest_start[runs]]
    run_tokens = rest_end[runs] - rest_start[runs]
    placed = group >= 0
    held_work = np.bincount(group[placed], weights=summed[placed], minlength=ring)
    held_tokens = np.bincount(group[placed], minlength=ring).astype(np.float64)
    target_tokens = seq_len / ring
    for i in np.argsort(-run_work, kind="stable"):
        # the group where adding the run grows the sum of squared (work, tokens) loads, relative to their
        # targets, least: heavy runs go where work is missing, token-heavy light ones where tokens are
        growth = run_work[i] * held_work / target_work ** 2 + run_tokens[i] * held_tokens / target_tokens ** 2
        g = int(np.argmin(growth))
        held_work[g] += run_work[i]
        held_tokens[g] += run_tokens[i]
        group[rest_start[runs[i]]:rest_end[runs[i]]] = g
    return group


def piece_starts(group, work):
    """Positions where a piece starts: a segment start, or a change of ring group (tiles stay inside pieces)."""
    changes = np.flatnonzero(np.diff(group) != 0) + 1
    return np.union1d(segment_starts(work), changes)
