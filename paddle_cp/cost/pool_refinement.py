"""A pool layout refined by local search (numpy only): work moved off its slowest rank a run at a time, each change
priced exactly by its tiles and exchange (attention/layout/pool.py refines its starting layouts with it)."""
from __future__ import annotations

import numpy as np

from .packed_layout import segments, token_cap, whole_cost
from .tiles import TILE, run_tile_counts

TRIED = 170  # pricings a refinement makes at most (0.3-0.6 ms each at 64K-256K tokens over 8 ranks)


def rebalanced(groups, end, ring, links, tries=TRIED):
    """`groups` (the ring group of every position) with work moved off the slowest rank (by predicted ms, and by
    tile ms where that is another), a run at a time (a run: a document's positions one rank holds consecutively,
    a whole document or a piece of a cut one): a run, or its last tokens (their queries see the rest: the most
    work per token moved, where documents are coarse beside a rank's share; tile multiples, those leaving the
    rank's later tokens on its tile grid, or cut at its document's tiles), moved to another rank, alone or for
    one of its runs of less work, within the memory bound (packed_layout.token_cap) on both ranks. Each change
    is priced exactly (tiles.run_tile_counts recounting the two ranks, the exchange on `links`, cost/links.py)
    and kept when the ranks' predicted ms from the slowest down fall (or stay and the slowest rank's tiles
    fall): placements price documents at a random tile offset, and the tiles they really make leave a few
    percent between ranks. Tried first: the changes whose estimated work shift (its queries' keys, priced as
    packed_layout.whole_cost) lowers the slowest rank most, then nearest half the gap between the two ranks,
    the four kinds in turn; at most `tries` pricings, from the best state so far. Returns `groups` itself when
    none helped. Numpy only: the same on every rank."""
    runs = Runs.of(groups, end)
    refined = refine(runs, runs.priced(ring, links), ring, links, tries)[0]
    return groups if refined is runs else refined.groups()


class Runs:
    """A layout of the joined row as its runs (consecutive positions of one document on one rank), in position
    order: `start`, `length`, `rank`, `doc_start`, `doc_end` (its document's), int64 [runs] each."""

    def __init__(self, start, length, rank, doc_start, doc_end):
        self.start, self.length, self.rank, self.doc_start, self.doc_end = start, length, rank, doc_start, doc_end
        self.counts = None  # their TileCounts, once priced

    @classmethod
    def of(cls, groups, end):
        doc_starts, _ = segments(end)
        first = np.zeros(len(groups), bool)
        first[doc_starts] = True
        first[1:] |= groups[1:] != groups[:-1]
        start = np.flatnonzero(first)
        doc_start = doc_starts[np.searchsorted(doc_starts, start, side="right") - 1]
        return cls(start, np.diff(np.append(start, len(groups))), groups[start], doc_start, np.ravel(end)[start])

    @property
    def work(self):
        """Estimated ms of each run's queries (packed_layout.whole_cost of its document up to it, less before it)."""
        before = self.start - self.doc_start
        return whole_cost(before + self.length) - whole_cost(before)

    def work_before(self, d, tail):
        """Estimated ms of runs `d`'s queries but their last `tail`."""
        before = self.start[d] - self.doc_start[d]
        return whole_cost(before + self.length[d] - tail) - whole_cost(before)

    def groups(self):
        return np.repeat(self.rank, self.length)

    def priced(self, ring, links, before=None, changed=()):
        """(each rank's predicted ms, its tile ms, the score a change must lower: each rank's ms from the slowest
        down, then the slowest rank's tile ms, where the exchange or the fixed cost leaves the first flat); with
        `before` (runs these are a change of, priced) only the ranks `changed` recounted. Keeps the counts, for
        pricing a change of these."""
        counts = run_tile_counts(self.start, self.length, self.rank, self.doc_end, ring,
                                 None if before is None else before.counts, changed)
        self.counts = counts
        rank_ms, tile_ms = links.rank_ms(counts), counts.step_ms().sum(axis=1)
        return rank_ms, tile_ms, (*np.round(np.sort(rank_ms)[::-1], 6).tolist(), float(tile_ms.max()))

    def changed(self, d, g, tail=0, e=-1):
        """These runs with run `d` moved to rank `g` (with `tail`, only its last `tail` positions), and run `e`
        (-1: none) to d's rank. Runs of one document left side by side on one rank are joined."""
        start, length, rank, doc_start, doc_end = (a.copy() for a in (self.start, self.length, self.rank,
                                                                      self.doc_start, self.doc_end))
        if e >= 0:
            rank[e] = rank[d]
        if tail:
            start, doc_start, doc_end, rank = (np.insert(a, d + 1, v) for a, v in (
                (start, start[d] + length[d] - tail), (doc_start, doc_start[d]), (doc_end, doc_end[d]), (rank, g)))
            length = np.insert(length, d + 1, tail)
            length[d] -= tail
        else:
            rank[d] = g
        new = np.ones(len(start), bool)
        new[1:] = (rank[1:] != rank[:-1]) | (doc_start[1:] != doc_start[:-1])
        first = np.flatnonzero(new)
        return Runs(start[first], np.add.reduceat(length, first), rank[first], doc_start[first], doc_end[first])


def refine(runs, priced, ring, links, tries=TRIED):
    """`rebalanced`'s search: (runs, their priced) after at most `tries` pricings."""
    cap = token_cap(int(runs.length.sum()), ring)
    left = tries
    while left:
        for d, g, tail, e in _options(runs, priced, ring, cap, left):
            left -= 1
            trial = runs.changed(d, g, tail, e)
            trial_priced = trial.priced(ring, links, runs, (int(runs.rank[d]), g))
            if trial_priced[2] < priced[2]:
                runs, priced = trial, trial_priced
                break
        else:
            break
    return runs, priced


def _options(runs, priced, ring, cap, most):
    """(run d, rank g, tail, run e or -1) of each change off the slowest rank (by ms, and by tile ms) within the
    memory bound `cap`: run d (with `tail`, its last `tail` positions) moved to g, alone or for run e of g, of
    less work. First those whose estimated work shift (packed_layout.whole_cost of the queries' keys) lowers
    the slowest rank most (by the gap to g and the other ranks), then nearest half the gap; the `most` first
    of the four kinds taken in turn."""
    work, length, rank = runs.work, runs.length, runs.rank
    tokens = np.bincount(rank, weights=length, minlength=ring)
    ranks = np.arange(ring)
    found = ([], [], [], [])  # of moves, swaps, tails, tails for a run: (estimate, d, e, g, tail) arrays
    for slowest in sorted({int(np.argmax(by)) for by in priced[:2]}):
        by = priced[0] if int(np.argmax(priced[0])) == slowest else priced[1]
        half_gap = (by[slowest] - by) / 2  # [R]
        others = np.array([np.delete(by, [slowest, g]).max(initial=0) for g in ranks])  # [R]: the rest's slowest

        def add(kind, shift, d, e, g, tail):  # estimated: the slowest's fall, then how near half the gap
            fall = by[slowest] - np.maximum(np.maximum(by[slowest] - shift, by[g] + shift), others[g])
            found[kind].append((-fall + 1e-3 * np.abs(shift - half_gap[g]), d, e, g, tail))

        mine, theirs = np.flatnonzero(rank == slowest), np.flatnonzero(rank != slowest)
        i, g = np.nonzero((tokens[None, :] + length[mine][:, None] <= cap) & (ranks != slowest)[None, :])
        add(0, work[mine[i]], mine[i], np.full(len(i), -1), g, np.zeros(len(i), np.int64))  # [mine, R] fitting
        shifted = length[mine][:, None] - length[theirs][None, :]  # [mine, theirs]
        i, j = np.nonzero((work[theirs][None, :] < work[mine][:, None]) & (tokens[slowest] - shifted <= cap)
                          & (tokens[rank[theirs]][None, :] + shifted <= cap))
        add(1, work[mine[i]] - work[theirs[j]], mine[i], theirs[j], rank[theirs[j]], np.zeros(len(i), np.int64))
        d, tail = _tails(runs, mine)  # [P]: each run's tails, shifting up to twice the largest half gap
        shift = work[d] - runs.work_before(d, tail)
        d, tail, shift = (a[shift <= 2 * half_gap.max()] for a in (d, tail, shift))
        i, g = np.nonzero((tokens[None, :] + tail[:, None] <= cap) & (ranks != slowest)[None, :])  # [P, R]
        add(2, shift[i], d[i], np.full(len(i), -1), g, tail[i])
        shifted = tail[:, None] - length[theirs][None, :]  # [P, theirs]
        i, j = np.nonzero((work[theirs][None, :] < shift[:, None]) & (tokens[slowest] - shifted <= cap)
                          & (tokens[rank[theirs]][None, :] + shifted <= cap))
        add(3, shift[i] - work[theirs[j]], d[i], theirs[j], rank[theirs[j]], tail[i])
    kinds = []
    for kind in found:  # each kind's `most` first, first first; then the kinds taken in turn
        estimate, d, e, g, tail = (np.concatenate([f[i] for f in kind]) for i in range(5))
        first = np.argpartition(estimate, most - 1)[:most] if len(estimate) > most else np.arange(len(estimate))
        first = first[np.argsort(estimate[first], kind="stable")]
        kinds.append((np.arange(len(first)), d[first], e[first], g[first], tail[first]))
    turn, d, e, g, tail = (np.concatenate([kind[i] for kind in kinds]) for i in range(5))
    order = np.argsort(turn, kind="stable")
    changes = zip(d[order].tolist(), g[order].tolist(), tail[order].tolist(), e[order].tolist())
    return list(dict.fromkeys(changes))[:most]  # each once: a tail may be found two ways (_tails)


def _tails(runs, mine):
    """(run, tail) int64 [P] each: the tails of runs `mine` (all of one rank) a change may cut off: tile multiples,
    those leaving the rank's later tokens on its tile grid, and cuts at its document's tiles."""
    length, before = runs.length[mine], (runs.start - runs.doc_start)[mine]
    ends = before + length
    by_length = (length - 1) // TILE  # tails k x TILE < length
    aligning = np.cumsum(length) % TILE  # tails this + k x TILE < length
    by_alignment = np.where(aligning > 0, (length - 1 - aligning) // TILE + 1, 0)
    first_cut = -(-(before + 1) // TILE)  # cuts at k x TILE of the document, inside the run
    by_document = np.maximum((ends - 1) // TILE - first_cut + 1, 0)
    run = np.concatenate([np.repeat(mine, n) for n in (by_length, by_alignment, by_document)])
    cuts = _counting(by_document) + np.repeat(first_cut, by_document)
    tail = np.concatenate([(_counting(by_length) + 1) * TILE,
                           np.repeat(aligning, by_alignment) + _counting(by_alignment) * TILE,
                           np.repeat(ends, by_document) - cuts * TILE])
    return run, tail


def _counting(counts):
    """0, 1, .. counts[i] - 1 for each i, concatenated."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
