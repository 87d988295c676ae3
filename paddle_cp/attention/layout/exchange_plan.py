"""Which k/v rows each ring member's kernels read from each other member, and the bytes that implies.

A member's kernels read another member's block only in the key tiles
where some of its queries see some key: key j is seen by the global query positions lo[j] <= i < hi[j]
(mask.seeing_positions: causality, documents, window, padding), and member g holds one of those iff
g's positions before hi[j] outnumber its positions before lo[j] (two searchsorted calls per member, over
every key at once). A tile is `tile` consecutive keys of the sender's block, counted from its first key
(tile_cost.py's tiles); a tile holding a seen key is read whole. A dense mask may hide more than the row
bounds: the plan reads what the bounds allow, which every rank knows without asking the others (a block the
dense mask hides whole still comes, and zeros go back as its rows' gradients: planned_exchange.send_grads).

Made once per batch on the host, from the layout's positions and the batch's documents and padding
(numpy: no device value is read), the same on every rank: each rank knows what it sends and receives.
Over a batch of several rows a key is read when some row's queries see it (one layout serves every row).
"""
from __future__ import annotations

import numpy as np

from ..masks.block_mask import seeing_positions
from ...cost import exchange as cost_exchange
from ...cost.tiles import TILE


class ExchangePlan:
    """`positions[g]`: ascending global positions of ring member g's tokens (its k/v block's rows, in order).
    `read_by(sender)`: bool [R, len(positions[sender])], the rows of the sender's block each member reads
    (a member never reads its own block through the exchange); `counts[g, h]`: rows member g reads from h."""

    def __init__(self, positions, causal, documents=None, window=None, valid=None, tile=TILE):
        self.positions = [np.asarray(p) for p in positions]
        self.tile = tile
        seq_len = sum(len(p) for p in self.positions)
        lo, hi = seeing_positions(np.arange(seq_len), causal, documents, window, valid)  # [b or 1, S]
        seen = np.stack([(np.searchsorted(p, hi) > np.searchsorted(p, lo)).any(axis=0)
                         for p in self.positions])  # [R, S]: member g's queries see key j
        self._read = [self._tiles_read(seen[:, p], sender) for sender, p in enumerate(self.positions)]
        self.counts = np.stack([read.sum(axis=1) for read in self._read], axis=1)  # [receiver, sender]

    def _tiles_read(self, seen, sender):
        """bool [R, L]: each member's rows of the sender's block, whole tiles where it sees some key."""
        length = seen.shape[1]
        read = np.zeros_like(seen)
        if length:
            tiles = np.logical_or.reduceat(seen, np.arange(0, length, self.tile), axis=1)  # [R, tiles]
            read = np.repeat(tiles, self.tile, axis=1)[:, :length]
        read[sender] = False
        return read

    @property
    def ring(self):
        return len(self.positions)

    def read_by(self, sender):
        return self._read[sender]

    def rows(self, receiver, sender):
        """int64: the sender's block rows (local indices, ascending) the receiver reads."""
        return np.flatnonzero(self._read[sender][receiver])

    def lengths(self):
        return np.array([len(p) for p in self.positions], np.int64)


def exchange_bytes(plan, kv_row_bytes, grad_row_bytes):
    """ExchangeBytes of a plan (cost/exchange.py); `kv_row_bytes`: one token's k and v on one member (batch
    rows, its heads, both head dims, their dtype); `grad_row_bytes`: the same in the gradients' dtype
    (rotation.GRAD_DTYPE)."""
    return cost_exchange.exchange_bytes(plan.counts, plan.lengths(), kv_row_bytes, grad_row_bytes)
