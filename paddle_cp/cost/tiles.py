"""What a packed batch's attention costs a GPU, counted in 128 x 128 tiles (numpy only, no device).

A rank holds its ring group's positions in ascending order; over the R ring steps its queries meet
every group's key block once. A flash kernel with per-tile masks (Paddle's flashmask_attention,
PyTorch's flex_attention) visits the (query tile, key tile) pairs of each step: an empty one (no
query sees any key) is skipped, a full one (every query sees every key) needs no mask, a partial one
costs about 1.5x a full one. Each step's keys are padded to a multiple of 128, so no tile straddles
two steps (the H200 measurement the model is fitted to did the same).

Counted exactly: key j is seen by the queries at global positions j <= i < end[j] (causal, inside its
document), which among a rank's sorted positions are one range of rows [lo_j, hi_j), where lo_j and
hi_j are the rank's positions before j and before end[j] (a prefix count, no search). In a key tile
the lo's grow with the key, so its non-empty query tiles are the union of each key's interval of
tiles, counted with a running maximum; the tile is full for query tile t when every key's rows cover
all 128 of t's rows.

Priced with a fit to an H200's timings (flex_attention forward + backward of one
layer, bf16, 32 query / 8 key-value heads, head dim 128; median error 1.6% over 252 rank timings):
    ms = 0.00354 x partial tiles + 0.00236 x full tiles + 1.59 per rank.
A rank of a hybrid group computes 1/U of the heads of its group's tiles; the fixed cost stays whole.
"""
from __future__ import annotations

import numpy as np

TILE = 128
PARTIAL_MS = 0.00354  # one partial tile, forward + backward
FULL_MS = 0.00236  # one full tile
RANK_MS = 1.59  # per rank and layer, whatever its tiles (launches, ring steps' fixed cost)
FIT_HEADS, FIT_HEAD_DIM = 32, 128  # the shape the rates were measured at


class TileCounts:
    """Per ring group r: `partial_from[r, g]`, `full_from[r, g]`: its partial and full tiles against group g's
    keys over the batch's rows; `partial[r]`, `full[r]`: over all its steps; `visited[r, g]`: non-empty
    tiles against g's keys (0: the step needs no kernel call); `read[r, g]`: the rows of g's block r reads
    (whole key tiles holding a key some query of r sees in some row; 0 for g = r: exchange_plan.py's
    counts); `tokens[r]`: the positions it holds. (A plain class: the GPU script loads this file alone.)"""

    def __init__(self, partial_from, full_from, read, tokens):
        self.partial_from, self.full_from, self.read, self.tokens = partial_from, full_from, read, tokens

    @property
    def partial(self):
        return self.partial_from.sum(axis=1)

    @property
    def full(self):
        return self.full_from.sum(axis=1)

    @property
    def visited(self):
        return self.partial_from + self.full_from

    def step_ms(self, ulysses=1, head_scale=1.0):
        """float [R, R]: predicted ms of group r's tiles against group g's keys (one ring step, a rank)."""
        return (PARTIAL_MS * self.partial_from + FULL_MS * self.full_from) * head_scale / ulysses

    def rank_ms(self, ulysses=1, head_scale=1.0):
        """Predicted ms of each rank of each group (fwd + bwd of one attention layer, H200); `head_scale`:
        the model's query heads x head dim over the fit's 32 x 128 (tiles cost in proportion)."""
        return self.step_ms(ulysses, head_scale).sum(axis=1) + RANK_MS

    def slowest_ms(self, ulysses=1, head_scale=1.0):
        return float(self.rank_ms(ulysses, head_scale).max())

    def kernel_steps(self):
        """Ring steps per group whose key block has a tile its queries see: one kernel call each and direction."""
        return (self.visited > 0).sum(axis=1)


def document_ends(position_in_document, document_id):
    """int64 [S]: where the document of each position ends (one row; documents are consecutive runs of ids)."""
    document_id = np.asarray(document_id)
    start = np.arange(len(document_id)) - np.asarray(position_in_document)
    new = np.flatnonzero(np.diff(document_id) != 0) + 1
    bounds = np.concatenate([new, [len(document_id)]])
    return bounds[np.searchsorted(bounds, start, side="right")].astype(np.int64)


def tile_counts(groups, end, ring):
    """`groups`: the ring group of every position (int [S]); `end`: int [rows, S] or [S], key j's
    document end (it is seen by positions j <= i < end[j]). -> TileCounts of the layout."""
    groups = np.asarray(groups, dtype=np.int64)
    end = np.atleast_2d(np.asarray(end, dtype=np.int64))
    seq_len = len(groups)
    tokens = np.bincount(groups, minlength=ring)
    order = np.argsort(groups.astype(np.int16), kind="stable")  # the keys, group after group, ascending in each (radix)
    block_start = np.concatenate([[0], np.cumsum(tokens)])
    block_tiles = -(-tokens // TILE)
    tile_start = np.concatenate([[0], np.cumsum(block_tiles)])
    in_block = np.arange(seq_len) - np.repeat(block_start[:-1], tokens)
    key_tile = np.repeat(tile_start[:-1], tokens) + in_block // TILE  # [S]: tile of each ordered key
    whole_tile = np.bincount(key_tile, minlength=tile_start[-1]) == TILE  # padding keys are seen by none
    tile_block = np.repeat(np.arange(ring), block_tiles)
    in_block_of = (tile_block[:, None] == np.arange(ring)[None, :]).astype(np.int64)  # [tiles, R]
    new_tile = np.diff(key_tile, prepend=-1) != 0
    jump = np.diff(order, prepend=-2) != 1
    zeros = np.zeros((ring, ring), np.int64)
    counts = TileCounts(zeros, zeros.copy(), zeros.copy(), tokens)
    tiles_read = np.zeros((ring, tile_start[-1]), bool)  # [R, key tiles]: some query of r sees a key of it
    for row_end in end:
        tiles_read |= _count_row(counts, groups, row_end, order, block_start, key_tile, new_tile | jump, whole_tile,
                                 in_block_of)
    counts.read = (tiles_read * np.bincount(key_tile, minlength=tile_start[-1])) @ in_block_of
    np.fill_diagonal(counts.read, 0)  # a group's own block is not exchanged
    return counts


def row_runs(groups, end):
    """(start, length, group, end) int64 [runs] each, for run_tile_counts: the runs of one row whose ring group
    of every position is `groups` and key j's document end `end[j]` (int [S] or [1, S]): positions of one
    document on one group, consecutive."""
    groups, end = np.asarray(groups, np.int64), np.ravel(end).astype(np.int64)
    start = np.flatnonzero(np.concatenate([[True], (np.diff(groups) != 0) | (np.diff(end) != 0)]))
    return start, np.diff(np.append(start, len(groups))), groups[start], end[start]


def run_tile_counts(start, length, group, end, ring, previous=None, changed=()):
    """tile_counts of one row given by its runs, counted per run and key tile instead of per position (a layout
    search prices many): run i holds the `length[i]` consecutive positions from `start[i]` (ascending, no two
    overlapping), all of one document ending at `end[i]`, on ring group `group[i]`. The same counts as
    tile_counts of the row whose positions the runs cover; a fragment here is a run's keys in one key tile (a
    fragment of tile_counts, or part of one). With `previous` (the TileCounts of these runs before a change of
    the groups `changed`, no other group's positions changed) only the rows and columns of `changed` are
    counted, from the fragments of the documents they hold (no other fragment has a query or key of theirs);
    the other counts are previous's."""
    start, length, group, end = (np.asarray(a, np.int64) for a in (start, length, group, end))
    tokens = np.bincount(group, weights=length, minlength=ring).astype(np.int64)
    block_tiles = -(-tokens // TILE)
    tile_start = np.concatenate([[0], np.cumsum(block_tiles)])
    keyed = np.lexsort((start, group))  # the runs in key order: group after group, ascending in each
    run_group, run_length = group[keyed], length[keyed]
    local = np.cumsum(run_length) - run_length - (np.cumsum(tokens) - tokens)[run_group]  # offset in its block
    first = local // TILE
    spans = (local + run_length - 1) // TILE - first + 1  # key tiles each run's keys lie in
    run = np.repeat(np.arange(len(keyed)), spans)  # [F]: the run of each fragment, in key order
    tile_in_run = first[run] + np.arange(len(run)) - np.repeat(np.cumsum(spans) - spans, spans)
    lo_local = np.maximum(local[run], tile_in_run * TILE)
    size = np.minimum(local[run] + run_length[run], (tile_in_run + 1) * TILE) - lo_local
    owner = run_group[run]
    tile = tile_start[owner] + tile_in_run
    keys = np.bincount(tile, weights=size, minlength=tile_start[-1]).astype(np.int64)
    in_block_of = (np.repeat(np.arange(ring), block_tiles)[:, None] == np.arange(ring)[None, :]).astype(np.int64)
    held = np.zeros((ring, len(start) + 1), np.int64)  # [R, runs + 1]: each group's positions in the runs before
    held[:, 1:] = np.cumsum(np.where(group[None, :] == np.arange(ring)[:, None], length[None, :], 0), axis=1)

    def rows_before(x):  # [R, F]: each group's positions before x
        i = np.maximum(np.searchsorted(start, x, side="right") - 1, 0)
        inside = np.clip(x - start[i], 0, length[i])
        return held[:, i] + np.where(group[i][None, :] == np.arange(ring)[:, None], inside[None, :], 0)

    zeros = np.zeros((ring, ring), np.int64)
    counts = TileCounts(zeros, zeros.copy(), zeros.copy(), tokens)
    first_key, last_end = start[keyed][run] + lo_local - local[run], end[keyed][run]
    if previous is not None:  # the fragments of documents some changed group holds
        touched = np.zeros(ring, bool)
        touched[list(changed)] = True
        ends = np.concatenate([[-1], np.unique(end[touched[group]])])  # the changed groups' documents, by end
        kept = ends[np.minimum(np.searchsorted(ends, last_end), len(ends) - 1)] == last_end
        first_key, last_end, size, owner, tile = (a[kept] for a in (first_key, last_end, size, owner, tile))
        present = tile[np.diff(tile, prepend=-1) != 0]  # key tiles with a kept fragment: one with other keys is not
        whole = np.bincount(tile, weights=size, minlength=len(keys))[present] == TILE  # full for changed rows
        keys, in_block_of = keys[present], in_block_of[present]
    else:
        whole = keys == TILE
    if len(tile):
        seen = _add_fragments(counts, rows_before(first_key), rows_before(last_end), size, owner, tile, whole,
                              in_block_of)
        counts.read = (seen * keys) @ in_block_of
    np.fill_diagonal(counts.read, 0)  # a group's own block is not exchanged
    if previous is not None:
        recounted = touched[:, None] | touched[None, :]  # [R, R]: a changed group's row or column
        for name in ("partial_from", "full_from", "read"):
            setattr(counts, name, np.where(recounted, getattr(counts, name), getattr(previous, name)))
    return counts


def _count_row(counts, groups, row_end, order, block_start, key_tile, breaks, whole_tile, in_block_of):
    """Add one row's tiles; returns bool [R, key tiles]: the key tiles each group's queries see in this row. A
    fragment is a run of a block's keys in one key tile, consecutive positions and one document: its keys share
    their last row, and their first rows are consecutive (for the group holding them) or equal (for any other),
    so each group sees it as one interval of query tiles."""
    key_end = row_end[order]
    starts = np.flatnonzero(breaks | (np.diff(key_end, prepend=-1) != 0))  # fragments, in key order
    size = np.diff(np.append(starts, len(order)))
    first_key, last_end, owner = order[starts], key_end[starts], groups[order[starts]]
    blocks = [order[a:b] for a, b in zip(block_start[:-1], block_start[1:])]  # each group's positions
    lo = np.stack([np.searchsorted(block, first_key) for block in blocks])  # [R, F]: rows before the fragment
    hi = np.stack([np.searchsorted(block, last_end) for block in blocks])  # [R, F]: and before its document's end
    return _add_fragments(counts, lo, hi, size, owner, key_tile[starts], whole_tile, in_block_of)


def _add_fragments(counts, lo, hi, size, owner, tile, whole_tile, in_block_of):
    """Add the tiles of fragments in key order (`size` keys each, of group `owner`, in key tile `tile`; `lo`,
    `hi`: int [R, F], each group's rows before the fragment's first key and before its document's end);
    returns bool [R, key tiles]: the key tiles each group's queries see."""
    ring = len(counts.tokens)
    own = np.arange(ring)[:, None] == owner[None, :]
    lo_last = lo + np.where(own, size[None, :] - 1, 0)  # the fragment's last key's first row
    seen = hi > lo
    first_tile = lo // TILE
    last_tile = np.where(seen, (hi - 1) // TILE, -1)
    spread = int(counts.tokens.max()) // TILE + 2  # separates key tiles in one running maximum
    offset = tile * spread
    reach = np.maximum.accumulate(last_tile + offset, axis=1)  # furthest query tile so far in the key tile
    before = np.maximum(np.concatenate([np.full((ring, 1), -spread), reach[:, :-1]], axis=1) - offset, -1)
    added = np.maximum(last_tile - np.maximum(first_tile, before + 1) + 1, 0)  # query tiles this fragment adds
    tile_first = np.flatnonzero(np.diff(tile, prepend=-1))
    nonempty = np.add.reduceat(added, tile_first, axis=1)  # [R, key tiles]
    lo_max = np.maximum.reduceat(lo_last, tile_first, axis=1)
    hi_min = np.minimum.reduceat(hi, tile_first, axis=1)  # an unseen fragment (hi <= lo) leaves no full tile
    full = np.where(whole_tile, np.maximum(hi_min // TILE + (-lo_max // TILE), 0), 0)
    counts.full_from += full @ in_block_of
    counts.partial_from += (nonempty - full) @ in_block_of
    return nonempty > 0
