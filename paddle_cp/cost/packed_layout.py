"""The layout of a packed batch: of a few candidate layouts, the one whose slowest rank a GPU would
finish first, by the tile model (tile_cost.py), under a memory bound (no ring group above 1.05 x S/R
tokens; S/R + 2R on rows of under 40R tokens per group). Numpy only:
`ring_groups(position_in_document, document_id, R)` is the function a GPU measurement of layouts can price
(`--layout mine=paddle_cp/cost/packed_layout.py:ring_groups`).

Why candidates: on a flash kernel a rank pays for tiles, and cutting a short document into 2R pieces
turns its tiles partial and multiplies them (on an H200, short documents so cut ran 1.3-2.8x slower than
2R chunks), while a long document kept whole leaves its rank the slowest. Which wins depends on the batch's lengths, so each batch prices:
- `chunks`: 2R equal chunks, group r holding r and 2R-1-r (Paddle's layout; any batch);
- `pairs`: equal query-key pairs per group (balance.py; every document in 2R pieces);
- `whole`, `cut>L`, `uncut`: documents longer than L (`whole`: 2R tiles; `uncut`: none) cut into 2R tile-aligned pieces,
  group r holding pieces r and 2R-1-r; the others whole, largest predicted cost first, each on the
  group predicted cheapest among those with room for it (a document no group has room for is cut
  at tile boundaries over the groups with the most room);
- `node-cut>L` (rings over several nodes): `cut>L` with each cut document's pieces on the groups of one node.
Priced by tiles alone, or with `links` (link_cost.LinkCost) by tiles and each rank's planned k/v exchange on
the links it comes over (NVLink within a node, the network across), which is how SequenceLayout chooses.
The choice: of the candidates whose slowest rank is within 1% of the cheapest (the model's own error is
1.6%; on small batches the fixed 1.59 ms per rank is nearly all of it), the most even query-key work,
which is what a kernel with small tiles (the CPU's) pays.

Rows: one layout serves every row of a batch (a rank's tensors are [b, s_local, ...]); a "document" is
then a run of positions inside one document in every row (cut wherever some row's document starts),
and the model prices every row.
"""
from __future__ import annotations

import time

import numpy as np

try:
    from .balance import balanced_groups
    from .tiles import FULL_MS, PARTIAL_MS, TILE, document_ends, row_runs, run_tile_counts, tile_counts
except ImportError:  # loaded by file path (balance_gpu.py --layout): its numpy-only siblings, by path too
    import importlib.util
    import pathlib

    def _sibling(name):
        spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    balanced_groups = _sibling("balance").balanced_groups
    _tiles = _sibling("tiles")
    FULL_MS, PARTIAL_MS, TILE = _tiles.FULL_MS, _tiles.PARTIAL_MS, _tiles.TILE
    document_ends, tile_counts = _tiles.document_ends, _tiles.tile_counts
    row_runs, run_tile_counts = _tiles.row_runs, _tiles.run_tile_counts

MEMORY_BOUND = 1.05  # most tokens a ring group may hold, over S/R
NEAR = 1.01  # slowest ranks within this of the cheapest count as equal
CUT_LONGER_THAN = (2, 8, 32, None)  # the `cut>L` candidates: L = this x R tiles (2: `whole`; None: `uncut`)


class Candidate:
    """A priced layout: `groups` (ring group of every position), its TileCounts, the slowest rank's
    predicted ms, its slowest group's query-key pairs over the mean, and the host ms (CPU time) that
    building and pricing it took."""

    def __init__(self, name, groups, counts, slowest_ms, work_imbalance):
        self.name, self.groups, self.counts = name, groups, counts
        self.slowest_ms, self.work_imbalance = slowest_ms, work_imbalance
        self.host_ms = None
        self.placement = None  # a joint stage's placement around it (choose's `joint`)


def chunk_sizes(seq_len, ring):
    """Sizes of the 2R ring chunks; extra tokens go to chunks 0..R-1, then 2R-1 down to R (one per group
    before any gets a second: local lengths differ by at most one)."""
    chunks = 2 * ring
    order = list(range(ring)) + list(range(chunks - 1, ring - 1, -1))
    sizes = [seq_len // chunks] * chunks
    for chunk in order[: seq_len % chunks]:
        sizes[chunk] += 1
    return sizes


def chunk_groups(seq_len, ring):
    chunk = np.repeat(np.arange(2 * ring), chunk_sizes(seq_len, ring))
    return np.where(chunk < ring, chunk, 2 * ring - 1 - chunk)


def token_cap(seq_len, ring):
    """The most tokens a ring group may hold: 1.05 x S/R, or S/R + 2R where that is more (rows under 40R
    tokens per group, where a few tokens are no memory and the pairs layout needs them)."""
    return max(-(-seq_len // ring) + 2 * ring, int(MEMORY_BOUND * seq_len / ring))


def whole_cost(length):
    """Predicted ms of a document kept whole on one rank at a random tile offset: the lower triangle of
    the tiles it spans, those it covers completely full (what the greedy placement ranks documents by)."""
    spanned = length / TILE + 1
    inside = np.maximum(length / TILE - 1, 0)
    full = inside * np.maximum(inside - 1, 0) / 2
    return PARTIAL_MS * (spanned * (spanned + 1) / 2 - full) + FULL_MS * full


def zigzag(length, ring, turn=0):
    """Group of each position of a document cut into 2R pieces at tile boundaries: group (r + turn) % R
    holds pieces r and 2R-1-r (turning from document to document spreads the pieces' rounding)."""
    bounds = np.round(np.arange(2 * ring + 1) * length / (2 * ring) / TILE).astype(np.int64) * TILE
    bounds[-1] = length
    piece = np.repeat(np.arange(2 * ring), np.diff(np.minimum(bounds, length)))
    return (np.where(piece < ring, piece, 2 * ring - 1 - piece) + turn) % ring


def cut_and_whole(starts, lengths, seq_len, ring, longer_than, nodes=None):
    """Documents longer than `longer_than` in zigzag pieces, the others whole by greedy predicted cost; with
    `nodes` (the node of each group) a cut document's pieces stay on one node, the one predicted cheapest."""
    groups = np.full(seq_len, -1, np.int64)
    cap = token_cap(seq_len, ring)
    tokens = np.zeros(ring, np.int64)
    cost = np.zeros(ring)
    cut = lengths > longer_than
    for turn, (start, length) in enumerate(zip(starts[cut], lengths[cut])):
        if nodes is None:
            piece = zigzag(length, ring, turn)
        else:
            node = min(np.unique(nodes), key=lambda n: cost[nodes == n].sum())
            members = np.flatnonzero(nodes == node)
            piece = members[zigzag(length, len(members), turn)]
        place_pieces(groups, start, piece, whole_cost(length), tokens, cost)
    whole = np.flatnonzero(~cut)
    place_whole(groups, whole[np.argsort(-lengths[whole], kind="stable")], starts, lengths,
                lambda d: whole_cost(lengths[d]), tokens, cost, cap)
    return groups


def place_pieces(groups, start, piece, document_cost, tokens, cost):
    """A document cut: `piece` the group of each of its positions from `start`; its predicted cost shared by
    the query-key pairs each group computes. `groups`, `tokens`, `cost` updated in place."""
    groups[start:start + len(piece)] = piece
    tokens += np.bincount(piece, minlength=len(tokens))
    pairs = np.bincount(piece, weights=np.arange(1, len(piece) + 1), minlength=len(tokens))  # its queries' keys
    cost += document_cost * pairs / pairs.sum()


def place_whole(groups, order, starts, lengths, cost_of, tokens, cost, cap):
    """Documents `order` whole, in that order, each on the group of least predicted cost (`cost_of(d)` its
    own) with room under `cap`; where none has room, the emptiest groups filled in turn, cut at tile
    boundaries where they can be. `groups`, `tokens`, `cost` updated in place."""
    for d in order:
        start, length = starts[d], lengths[d]
        room = tokens + length <= cap
        if room.any():
            g = int(np.argmin(np.where(room, cost, np.inf)))
            groups[start:start + length] = g
            tokens[g] += length
            cost[g] += cost_of(d)
        else:
            fill_emptiest(groups, start, length, tokens, cost, cap)


def fill_emptiest(groups, start, length, tokens, cost, cap):
    """A document no group has room for: the emptiest groups filled in turn, at tile boundaries if they can."""
    for aligned in (True, False):
        for g in np.argsort(tokens, kind="stable"):
            take = max(0, min(length, cap - tokens[g]))  # a group over the cap by cut pieces takes none
            if aligned and take < length:
                take -= take % TILE
            groups[start:start + take] = g
            tokens[g] += take
            cost[g] += whole_cost(take)
            start, length = start + take, length - take


def segments(end):
    """(starts, lengths) of the runs inside one document in every row (`end`: int [rows, S])."""
    end = np.atleast_2d(end)
    starts = np.flatnonzero(np.concatenate([[True], (np.diff(end, axis=1) != 0).any(axis=0)]))
    return starts, np.diff(np.append(starts, end.shape[1]))


def candidates(end, work, ring, nodes=None):
    """(name, ring group of every position) of each candidate for a batch (`end`: each key's document
    end, `work`: the keys each query sees, both int [rows, S]), built one at a time; with `nodes` (the node
    of each group, several) also `node-cut>L`: `cut>L` with each cut document's pieces on one node."""
    seq_len = np.shape(end)[-1]
    starts, lengths = segments(end)
    yield "chunks", chunk_groups(seq_len, ring)
    yield "pairs", balanced_groups(work, ring)
    cut_before = -1
    for times in CUT_LONGER_THAN:
        longer_than = times * ring * TILE if times else seq_len
        cut = int((lengths > longer_than).sum())
        if cut != cut_before:  # each threshold cuts fewer documents: a new candidate where it cuts another set
            name = "whole" if times == 2 else f"cut>{longer_than}" if cut else "uncut"
            yield name, cut_and_whole(starts, lengths, seq_len, ring, longer_than)
            if cut and nodes is not None and 1 < len(np.unique(nodes)) < ring:
                yield f"node-cut>{longer_than}", cut_and_whole(starts, lengths, seq_len, ring, longer_than, nodes)
        cut_before = cut


def price(name, groups, end, work, ring, ulysses=1, links=None):
    """A Candidate; `links` (link_cost.LinkCost, or None: tiles alone) prices its k/v exchange too."""
    one_row = np.ndim(end) == 1 or len(end) == 1  # counted per run: the same counts, a few times faster
    counts = run_tile_counts(*row_runs(groups, end), ring) if one_row else tile_counts(groups, end, ring)
    summed = np.bincount(groups, weights=np.atleast_2d(work).sum(axis=0), minlength=ring)
    slowest = counts.slowest_ms(ulysses) if links is None else float(links.rank_ms(counts, ulysses).max())
    return Candidate(name, groups, counts, slowest, float(summed.max() / summed.mean()))


def choose(end, work, ring, ulysses=1, links=None, joint=None):
    """(the chosen Candidate, {name: Candidate} of every one priced): of the candidates within the memory
    bound whose groups hold at least one token per Ulysses rank, the most even work among those NEAR
    the cheapest slowest rank; with `links` (a link_cost.LinkCost) each rank's exchange is priced with its
    tiles. `joint(groups, counts)`: another stage placed around each candidate (a vision-language batch's vision
    pieces, cost/vision_layout.py), whose placement's slowest rank of both stages prices it instead."""
    seq_len = np.shape(end)[-1]
    priced = {}
    clock = time.process_time()
    for name, groups in candidates(end, work, ring, None if links is None else links.nodes):
        priced[name] = candidate = price(name, groups, end, work, ring, ulysses, links)
        if joint is not None:
            candidate.placement = joint(groups, candidate.counts)
            candidate.slowest_ms = candidate.placement.slowest_ms
        priced[name].host_ms, clock = (time.process_time() - clock) * 1e3, time.process_time()
    fits = [c for c in priced.values()
            if c.counts.tokens.max() <= token_cap(seq_len, ring) and c.counts.tokens.min() >= ulysses]
    cheapest = min(c.slowest_ms for c in fits)
    near = [c for c in fits if c.slowest_ms <= NEAR * cheapest]
    return min(near, key=lambda c: (c.work_imbalance, c.slowest_ms)), priced


def ring_groups(position_in_document, document_id, R):
    """The chosen layout of one packed row: int64 [S], the ring group of every position."""
    end = document_ends(position_in_document, document_id)[None]
    return choose(end, (np.asarray(position_in_document) + 1)[None], R)[0].groups
