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
from ...cost.packed_layout import CUT_LONGER_THAN, cut_and_whole, segments
from ...cost.pool_placement import placed_groups
from ...cost.pool_refinement import Runs, refine
from ...cost.tiles import TILE
from ..masks.block_mask import Documents
from .sequence_layout import DocumentSplit, SequenceLayout

STARTS_TRIED = 20  # changes priced on each of the REFINED starting layouts (0.3-0.6 ms each at 64K-256K tokens),
# then pool_refinement.TRIED on the best of them
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
    across nodes: fewer ranks share a document). The REFINED cheapest are refined (cost/pool_refinement.py) for
    STARTS_TRIED changes each, the best of them for its TRIED more: the layout whose slowest rank the tile model
    and the links predict faster (then its slowest rank's tiles). Fixed dp x sep's layout run as this one row can
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
    runs = [Runs.of(option, end) for option in options]
    priced = [(option, option.priced(layout.ring, layout.links)) for option in runs]
    if split == "documents":  # the cheapest refined a little, the best of them on
        priced = [refine(*start, layout.ring, layout.links, STARTS_TRIED)
                  for start in sorted(priced, key=lambda start: start[1][2])[:REFINED]]
        priced = [refine(*min(priced, key=lambda option: option[1][2]), layout.ring, layout.links)]
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
