"""Bytes of a ring layout's planned k/v exchange, from the rows each member's tiles read (numpy only).

`read[r, g]`: the rows of member g's block member r's kernels read (TileCounts.read, ExchangePlan.counts;
0 on the diagonal). Per forward + backward of one layer, g sends r those rows' k and v twice and r sends g
their gradients home (planned_exchange.py): 3 x the rows read. Without recomputation the k/v go in the
forward and again in the backward, which fetches them instead of every layer holding them until its backward.
Under recomputation they go in the first (no-grad) forward and in the replay, whose received rows
(`received_rows`, one layer's) its backward reads (attention/algorithms/ring.py), as long as the busiest
member's fit REPLAY_HOLD_LIMIT (`replay_holds`); past it the backward fetches them a third time (`kv_passes`
3: 4 x the rows read). The planner counts the same bytes (step_time.py) as the exchange moves.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .packed_layout import chunk_sizes
from .tiles import TILE

# Received k/v bytes one replay's ring calls (a layer's, or all those of a recompute call over several layers) may
# hold for its backward, beside the replay's own activations (Llama-3-8B at 128K tokens of one document over 8
# ranks, bf16: 224-448 MiB a layer). Past it (~290K tokens there),
# where attention's compute hides a third pass of k/v many times over and memory bounds the sequence, the
# backward fetches them again.
REPLAY_HOLD_LIMIT = 2 ** 30


class ExchangeBytes(NamedTuple):
    """Bytes each ring member sends in one forward + backward of one layer (int64 [R] each): `whole_blocks`
    with every block going to every member (k/v twice, their gradients home: what the `allgather` rotation
    sends, but its padding to the longest block), `planned` by the planned exchange (the same three, only the
    rows read), `read`: 3 x the k/v rows of its block the other members' tiles read."""

    whole_blocks: np.ndarray
    planned: np.ndarray
    read: np.ndarray


def link_bytes(read, kv_row_bytes, grad_row_bytes, kv_passes=2):
    """int64 [R, R]: bytes member g sends member r (what r receives from g) in one forward + backward;
    `kv_row_bytes`: one token's k and v on a member (batch rows, its heads, both head dims, their dtype);
    `grad_row_bytes`: the same in the gradients' dtype (rotation.GRAD_DTYPE); `kv_passes`: how often the k/v
    cross (3 under recomputation where the replay does not hold them: `replay_holds`)."""
    read = np.asarray(read, np.int64)
    return kv_passes * read * kv_row_bytes + read.T * grad_row_bytes


def received_rows(read):
    """int64 [R]: the k/v rows each member receives in one forward, what a replay's forward holds for its
    backward under recomputation."""
    return np.asarray(read, np.int64).sum(axis=1)


def replay_holds(received_bytes):
    """Whether a replayed ring forward holds the k/v it received for its backward: when the busiest member's
    (`received_bytes`, [R] or its maximum) are at most REPLAY_HOLD_LIMIT. Every member decides alike (its
    backward's shifts pair with the others')."""
    return int(np.max(received_bytes)) <= REPLAY_HOLD_LIMIT


def exchange_bytes(read, lengths, kv_row_bytes, grad_row_bytes):
    """ExchangeBytes of a layout whose members hold `lengths` rows (int [R]) and read `read` [R, R]."""
    read, lengths = np.asarray(read, np.int64), np.asarray(lengths, np.int64)
    # as a ring passing whole blocks along: a member forwards every block but the next member's (whose own it
    # is) and every block's gradient sum but its own (an all-gather and a reduce-scatter move as much)
    kv_whole = lengths.sum() - np.roll(lengths, -1)
    whole_blocks = 2 * kv_whole * kv_row_bytes + (lengths.sum() - lengths) * grad_row_bytes
    planned = link_bytes(read, kv_row_bytes, grad_row_bytes).sum(axis=0)
    return ExchangeBytes(whole_blocks, planned, 3 * read.sum(axis=0) * kv_row_bytes)


def chunk_reads(seq_len, ring, causal=True):
    """int64 [R, R]: `read` of one document of `seq_len` tokens in the 2R-chunk layout (member g holding
    chunks g and 2R-1-g). Causal: member r's last query, in chunk 2R-1-r, sees every key before it, so r reads
    g's chunk g and, for g > r, its chunk 2R-1-g too, in whole tiles of g's block (counted from its first
    row: tiles.tile_counts' tiles); full attention reads every block whole."""
    sizes = np.asarray(chunk_sizes(seq_len, ring), np.int64)
    first, second = sizes[:ring], sizes[::-1][:ring]  # chunk g, chunk 2R-1-g
    lengths = first + second
    if not causal:
        read = np.broadcast_to(lengths, (ring, ring)).copy()
    else:
        member = np.arange(ring)
        seen = first[None, :] + np.where(member[None, :] > member[:, None], second[None, :], 0)  # [r, g]
        read = np.minimum(-(-seen // TILE) * TILE, lengths[None, :])
    np.fill_diagonal(read, 0)
    return read
