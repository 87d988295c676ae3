"""The documents of a pool's joined rows placed over its R ranks by predicted cost (numpy only).

A pool's global batch holds many documents beside R ranks, some longer than a rank's share: the packed
chooser's candidates (packed_layout.py) cut every document above a length threshold over all R ranks, which
over a pool of two or more replicas cuts documents that the ranks of one replica could share, and places
the others by a first fit. Here, as MagiAttention's dispatch solver and Megatron's hybrid context parallel
do for their buckets, each rank gets an equal share of the predicted work, first by the fewest cuts:
- a document whose whole cost (packed_layout.whole_cost) is above a rank's share of the batch's, or whose
  tokens are above the memory bound, is cut into 2k tile-aligned zigzag pieces over the k ranks it needs
  (k = its cost over the share, rounded up), longest first, on the k cheapest ranks with room (of one node
  when the ring spans nodes and k fits in one: its exchange stays on NVLink);
- the others whole, longest processing time first: largest predicted cost first, each on the rank with the
  least predicted cost that has room for it (a document no rank has room for is cut at tile boundaries
  over the ranks with the most room, as the chooser does).
The estimate prices a whole document at a random tile offset; attention/layout/pool.py then refines the
placement with the tiles it really makes (moves, swaps and tail cuts off the slowest rank).
"""
from __future__ import annotations

import numpy as np

from .packed_layout import TILE, fill_emptiest, place_pieces, place_whole, token_cap, whole_cost, zigzag


def placed_groups(starts, lengths, total, ring, nodes=None):
    """int64 [total]: the rank of every position of a joined row whose documents (runs inside one document)
    start at `starts` with `lengths`; `nodes` (the node of each rank, or None): a cut document's ranks on one
    node where they fit."""
    groups = np.full(total, -1, np.int64)
    cap = token_cap(total, ring)
    tokens = np.zeros(ring, np.int64)
    cost = np.zeros(ring)
    each = whole_cost(lengths)
    share = each.sum() / ring
    needs = np.maximum(np.ceil(each / share - 0.05), -(-lengths // cap)).astype(np.int64)  # ranks a document needs
    cut = np.flatnonzero(needs > 1)
    for turn, d in enumerate(cut[np.argsort(-lengths[cut], kind="stable")]):
        start, length = starts[d], lengths[d]
        for k in range(min(int(needs[d]), ring), ring + 1):  # more ranks where the fewest have no room
            members = _cheapest(cost, tokens, -(-length // k) + TILE, k, cap, nodes)  # zigzag rounds to tiles
            if members is not None:
                break
        else:
            fill_emptiest(groups, start, length, tokens, cost, cap)
            continue
        place_pieces(groups, start, members[zigzag(length, k, turn)], each[d], tokens, cost)
    whole = np.flatnonzero(needs <= 1)
    place_whole(groups, whole[np.argsort(-each[whole], kind="stable")], starts, lengths, lambda d: each[d],
                tokens, cost, cap)
    return groups


def _cheapest(cost, tokens, piece_tokens, k, cap, nodes):
    """The k ranks (int64 [k]) of least predicted cost with room for a piece, of one node when some node has k
    such ranks (the node whose k cost least); None when fewer than k ranks have room."""
    room = tokens + piece_tokens <= cap
    ranks = [np.arange(len(cost))] if nodes is None else [np.flatnonzero(nodes == n) for n in np.unique(nodes)]
    for options in (ranks, [np.arange(len(cost))]):  # one node's first
        picks = [o[room[o]][np.argsort(cost[o[room[o]]], kind="stable")[:k]] for o in options if room[o].sum() >= k]
        if picks:
            return min(picks, key=lambda p: cost[p].sum())
    return None
