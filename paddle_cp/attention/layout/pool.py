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
from ...cost.packed_layout import segments, token_cap, whole_cost
from ...cost.pool_placement import placed_groups
from ...cost.tiles import TILE, run_tile_counts
from ..masks.block_mask import Documents
from .sequence_layout import DocumentSplit, SequenceLayout

MOVES_TRIED = 8  # whole-run changes a rebalancing prices at most (0.3-1 ms each at 64K-256K tokens over 8 ranks)
TAILS_TRIED = 4  # then tail cuts
REFINED = 2  # starting layouts refined (of the chooser's, the placement's, fixed dp x sep's: the cheapest)


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
    (replica d's rows laid out over ranks d x sep .. (d + 1) x sep - 1, as without the pool); the REFINED
    cheapest refined (`rebalanced`), and of those the one whose slowest rank the tile model and the links
    predict faster (then its slowest rank's tiles). Fixed dp x sep's layout run as this one row can cost more
    than the replicas' separate rows: a row's piece not a multiple of a tile leaves the next row's pieces on a
    rank off the tile grid, as a flashmask or flex kernel given one row would have them."""
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
            options.append(_replica_groups(layout, documents, batch, seq_len, replicas))
    priced = [(option, _priced(option, end, layout.ring, layout.links)) for option in options]
    if split == "documents":  # the cheapest refined
        priced = [_refined(*start, end, layout.ring, layout.links)
                  for start in sorted(priced, key=lambda start: start[1][2])[:REFINED]]
    best = min(priced, key=lambda option: option[1][2])[0]
    if best is groups:
        return chosen
    laid = copy.copy(chosen)
    laid.split, laid.windows, laid._last_batch = DocumentSplit(best, joined.keys_seen(), layout.ring), {}, None
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


def rebalanced(groups, end, ring, links, tries=MOVES_TRIED):
    """`groups` (the ring group of every position) with work moved from the slowest rank (by predicted ms, and by
    tile ms where that is another) to one of the three fastest, a run at a time (a run: a document's positions
    one rank holds consecutively, a whole document or a piece of a cut one): a run moved, or swapped with one of
    less work there, or its last tile-aligned tokens cut off to it (their queries see the rest: the most work
    per token moved, where documents are coarse beside a rank's share), within the memory bound
    (packed_layout.token_cap) on both ranks, each change kept only if the slowest rank's predicted ms (tiles
    and exchange on `links`, cost/links.py) falls, or stays and the slowest rank's tiles fall: placements price
    documents at a random tile offset, and the tiles they really make leave a few percent between ranks. The
    change tried first is the one whose estimated work shift (its queries' keys, priced as
    packed_layout.whole_cost) is nearest half the gap. Returns `groups` itself when none helped. Numpy only: the same on every rank."""
    return _refined(groups, _priced(groups, end, ring, links), end, ring, links, tries)[0]


def _refined(groups, priced, end, ring, links, tries=MOVES_TRIED):
    """`rebalanced`'s (groups, _priced of them), from `groups` and their `priced`."""
    cap = token_cap(len(groups), ring)
    tried = set()
    current = groups
    runs = _runs(current, end)
    for cutting in [False] * tries + [True] * TAILS_TRIED:  # whole runs first; a few tail cuts after
        start, length, owner, before = runs
        work = whole_cost(before + length) - whole_cost(before)
        tokens = np.bincount(current, minlength=ring)
        options = []
        for by in priced[:2]:  # each rank's ms, its tile ms
            slowest = int(np.argmax(by))
            mine = np.flatnonzero(owner == slowest)
            for g in [g for g in np.argsort(by) if g != slowest][:3]:
                half_gap = (by[slowest] - by[g]) / 2
                theirs = np.flatnonzero(owner == g)
                for d in mine:
                    key = (start[d], length[d], g)
                    if cutting:
                        tail = _tail_for(before[d], length[d], half_gap, cap - tokens[g])
                        if tail and (*key, -1, tail) not in tried:
                            shift = whole_cost(before[d] + length[d]) - whole_cost(before[d] + length[d] - tail)
                            options.append((abs(shift - half_gap), *key, -1, tail, slowest))
                        continue
                    if tokens[g] + length[d] <= cap and (*key, -1, 0) not in tried:
                        options.append((abs(work[d] - half_gap), *key, -1, 0, slowest))
                    for e in theirs[work[theirs] < work[d]]:
                        shifted = length[d] - length[e]
                        if tokens[g] + shifted <= cap and tokens[slowest] - shifted <= cap and \
                                (*key, start[e], 0) not in tried:
                            options.append((abs(work[d] - work[e] - half_gap), *key, start[e], 0, slowest))
        if not options:
            continue
        _, at, size, g, swapped, tail, slowest = min(options)
        tried.add((at, size, g, swapped, tail))
        trial = current.copy()
        trial[at + (size - tail if tail else 0):at + size] = g
        if swapped >= 0:
            e = int(np.searchsorted(start, swapped))
            trial[swapped:swapped + length[e]] = slowest
        trial_priced = _priced(trial, end, ring, links)
        if trial_priced[2] < priced[2]:
            current, priced = trial, trial_priced
            runs = _runs(current, end)
    return current, priced


def _priced(groups, end, ring, links):
    """(each rank's predicted ms, its tile ms, the score a change must lower: the slowest rank's ms, then the
    slowest rank's tile ms, where the exchange or the fixed cost leaves the first flat)."""
    start, length, owner, _ = _runs(groups, end)
    counts = run_tile_counts(start, length, owner, np.ravel(end)[start], ring)  # tile_counts' counts, per run
    rank_ms, tile_ms = links.rank_ms(counts), counts.step_ms().sum(axis=1)
    return rank_ms, tile_ms, (round(float(rank_ms.max()), 6), float(tile_ms.max()))


def _runs(groups, end):
    """(start, length, rank, positions of its document before it) of each run: consecutive positions of one
    document on one rank, int64 [runs] each."""
    doc_starts, _ = segments(end)
    first = np.zeros(len(groups), bool)
    first[doc_starts] = True
    first[1:] |= groups[1:] != groups[:-1]
    start = np.flatnonzero(first)
    length = np.diff(np.append(start, len(groups)))
    doc_start = doc_starts[np.searchsorted(doc_starts, start, side="right") - 1]
    return start, length, groups[start], start - doc_start


def _tail_for(before, length, half_gap, room):
    """Tokens (a multiple of TILE, 0: none) at the end of a run of `length` positions after `before` of its
    document whose queries, cut off to another rank, shift the work nearest `half_gap` there, within `room`."""
    tails = np.arange(TILE, min(length, room + 1), TILE)
    if not len(tails):
        return 0
    shift = whole_cost(before + length) - whole_cost(before + length - tails)
    return int(tails[np.argmin(np.abs(shift - half_gap))])


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
