"""One pool over dp x sep: a global batch laid out over every dp x sep rank at once (numpy only).

Fixed dp x sep gives each replica its own rows and lays them out over its sep group: a replica whose rows hold
long documents is slower than one whose rows hold short ones, and a row's documents are cut over sep ranks even
where a whole document would fit on one rank of another replica. The pool (Megatron-Core's dynamic context
parallel, ByteScale's data-aware DP/CP, chosen per batch here) sees the global batch, every replica's rows, on
every rank: its B rows of S tokens are joined end to end into one packed sequence of B x S tokens (a row's end
ends its last document), laid out over all R = dp x sep ranks as one ring by predicted cost (`pool_layout`, tiles
and exchange priced with the links): a document short enough stays whole on one rank, a
long one is cut over several (the pieces of a cut document on one node when the ring spans nodes). The planned
exchange (exchange_plan.py) then moves only the k/v rows other ranks' tiles read: documents whole on a rank
move nothing, whichever replica they came from.

A rank's tokens are positions of the joined sequence, position p being token p % S of row p // S of the global
batch. Ranks hold different token counts: each weights its mean loss by its share of the pool's tokens
(sequence/loss.py's loss_weight over the dp x sep group), which makes the averaged gradients one card's on the
global batch.
"""
from __future__ import annotations

import copy

import numpy as np

from ...cost.links import LinkCost
from ...cost.packed_layout import CUT_LONGER_THAN, cut_and_whole, segments, token_cap, whole_cost
from ...cost.pool_placement import placed_groups
from ...cost.tiles import TILE, run_tile_counts
from ..masks.block_mask import Documents
from .sequence_layout import DocumentSplit, SequenceLayout

STARTS_TRIED = 20  # changes priced on each of the REFINED starting layouts (0.3-0.6 ms each at 64K-256K tokens)
TRIED = 170  # then on the best of them
REFINED = 2  # starting layouts refined (the cheapest of the chooser's, the placements', fixed dp x sep's)


def joined_documents(documents, batch, seq_len):
    """The Documents of a [batch, seq_len] batch's rows joined into one row of batch x seq_len tokens: each
    row's documents (None: each row one document), shifted by the row's offset; no document crosses a row's end."""
    offset = (np.arange(batch, dtype=np.int64) * seq_len)[:, None]  # [batch, 1]
    if documents is None:
        start = np.broadcast_to(offset, (batch, seq_len))
        end = start + seq_len
        causal_only = False
    else:
        rows = np.broadcast_to(documents.start, (batch, seq_len))
        start = np.clip(rows, 0, seq_len) + offset
        end = np.clip(np.broadcast_to(documents.end, (batch, seq_len)), 0, seq_len) + offset
        causal_only = documents.causal_only
    return Documents(np.ascontiguousarray(start).reshape(1, -1), np.ascontiguousarray(end).reshape(1, -1),
                     causal_only)


def joined_valid(valid, batch, seq_len):
    """Padding of the joined row ([1, batch x seq_len] bool), from the batch's [batch, seq_len] (None: none)."""
    return None if valid is None else np.broadcast_to(valid, (batch, seq_len)).reshape(1, -1)


def pool_layout(layout, documents, batch, seq_len, split="documents", replicas=1):
    """The layout of the joined row over the pool: `layout` (a SequenceLayout of the p2p ring over the pool's R
    ranks, its links the pool's) for the batch's `documents` (Documents of [batch, seq_len], or None). Starting
    layouts: the chooser's (packed_layout.py over the joined row), with `split` 'documents' a placement by
    predicted cost (cost/pool_placement.py) and, with `replicas` (dp) dividing the rows, fixed dp x sep's
    (replica d's rows laid out over ranks d x sep .. (d + 1) x sep - 1, as without the pool), and on one node
    the placement and packed_layout's cut_and_whole with each cut document's pieces on one replica's ranks (as
    across nodes: fewer ranks share a document). The REFINED cheapest are refined (`rebalanced`) for
    STARTS_TRIED changes each, the best of them for TRIED more: the layout whose slowest rank the tile model and
    the links predict faster (then its slowest rank's tiles). Fixed dp x sep's layout run as this one row can
    cost more than the replicas' separate rows: a row's piece not a multiple of a tile leaves the next row's
    pieces on a rank off the tile grid, as a flashmask or flex kernel given one row would have them."""
    joined = joined_documents(documents, batch, seq_len)
    total = batch * seq_len
    end = np.clip(joined.end, 0, total)
    chosen = layout.for_batch(joined, split)
    groups = _groups_of(chosen, total)
    options = [groups]
    if split == "documents":
        starts, lengths = segments(end)
        nodes = layout.links.nodes if layout.links.nodes_spanned > 1 else None
        options.append(placed_groups(starts, lengths, total, layout.ring, nodes))
        if replicas > 1 and batch % replicas == 0:
            if nodes is None:  # cut documents' pieces on one replica's ranks, as over nodes
                by_replica = np.repeat(np.arange(replicas), layout.ring // replicas)
                options.append(placed_groups(starts, lengths, total, layout.ring, by_replica))
                options += [cut_and_whole(starts, lengths, total, layout.ring, times * layout.ring * TILE,
                                          by_replica) for times in CUT_LONGER_THAN if times]
            options.append(_replica_groups(layout, documents, batch, seq_len, replicas))
    options = [o for i, o in enumerate(options) if not any(np.array_equal(o, p) for p in options[:i])]
    runs = [_Runs.of(option, end) for option in options]
    priced = [(option, option.priced(layout.ring, layout.links)) for option in runs]
    if split == "documents":  # the cheapest refined a little, the best of them on
        priced = [_refined(*start, layout.ring, layout.links, STARTS_TRIED)
                  for start in sorted(priced, key=lambda start: start[1][2])[:REFINED]]
        priced = [_refined(*min(priced, key=lambda option: option[1][2]), layout.ring, layout.links)]
    best = min(priced, key=lambda option: option[1][2])[0]
    if best is runs[0]:
        return chosen
    laid = copy.copy(chosen)
    laid.split, laid.windows, laid._last_batch = DocumentSplit(best.groups(), joined.keys_seen(), layout.ring), {}, None
    return laid


def _groups_of(layout, total):
    """int64 [total]: the ring group of every position of `layout`."""
    groups = np.empty(total, np.int64)
    for g, positions in enumerate(layout.ring_positions(total)):
        groups[positions] = g
    return groups


def _replica_groups(layout, documents, batch, seq_len, replicas):
    """Fixed dp x sep as a layout of the joined row: replica d's batch / replicas rows over its sep ranks, each row
    split alike (one layout serves a replica's rows), by the documents layout on that replica's links."""
    sep, rows = layout.ring // replicas, batch // replicas
    groups = np.empty(batch * seq_len, np.int64)
    for d in range(replicas):
        mine = None
        if documents is not None:
            picked = [np.broadcast_to(a, (batch, seq_len))[d * rows:(d + 1) * rows] for a in (documents.start, documents.end)]
            mine = Documents(*picked, documents.causal_only)
        links = LinkCost(layout.links.nodes[d * sep:(d + 1) * sep], layout.links.links)
        replica = SequenceLayout("p2p", sep, links=links).for_batch(mine)
        row = _groups_of(replica, seq_len) + d * sep
        groups[d * rows * seq_len:(d + 1) * rows * seq_len] = np.tile(row, rows)
    return groups


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
    runs = _Runs.of(groups, end)
    refined = _refined(runs, runs.priced(ring, links), ring, links, tries)[0]
    return groups if refined is runs else refined.groups()


class _Runs:
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
        return _Runs(start[first], np.add.reduceat(length, first), rank[first], doc_start[first], doc_end[first])


def _refined(runs, priced, ring, links, tries=TRIED):
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


def row_positions(layout, batch, seq_len, index):
    """(rows, positions within their rows) of rank `index`'s tokens in the pool's `layout`, in local order: the
    global batch's [row, position] of each token the rank holds (its RoPE positions are the second)."""
    joined = layout.positions(batch * seq_len, index)
    return joined // seq_len, joined % seq_len


def token_counts(layout, batch, seq_len, counted=None):
    """int64 [R]: the tokens each pool rank holds; with `counted` ([batch, seq_len] bool: e.g. labels not
    ignored) only those. Their sum is the global batch's: loss_weight's denominator."""
    flat = None if counted is None else np.broadcast_to(counted, (batch, seq_len)).reshape(-1)
    return np.array([len(p) if flat is None else int(flat[p].sum())
                     for p in (layout.positions(batch * seq_len, r) for r in range(layout.world))], np.int64)
