"""Which keys each query sees, from global token positions.

A query at global position i sees the key at position j iff
    lo[j] <= i < hi[j]          (causality, documents, sliding window, padding)
and the dense mask, if any, allows (i, j). Causal: lo[j] = j. Documents:
[lo, hi) is clipped to the key's document. Sliding window w (PaddleFormers'
eager mask: i - w < j <= i): hi[j] <= j + w. A padding key: [lo, hi) empty.
A rank's query positions ascend, so the query rows that see key j are one
range [start[j], end[j]): Paddle's flashmask row indices, one kernel call
for a whole block (a ring step), and for the blockwise kernel the tiles no
query sees, skipped; the skipped work is counted. Knowing positions (not local
offsets) is what makes any layout (2N chunks, documents spread or whole) exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import paddle

from ... import runtime
from ..layout.sequence_layout import runs

# Additive masks mark "masked" with -inf or a dtype's min (PaddleFormers): anything this low adds
# nothing next to a visible key, so a tile of only such values is skipped.
MASKED_BELOW = -1e30


def attention_work(reset=False):
    """Query-key pairs computed and skipped by attention forwards on this rank (since the last reset)."""
    done = dict(runtime.state.attention_work)
    total = done["computed"] + done["skipped"]
    done["skipped_fraction"] = done["skipped"] / total if total else 0.0
    if reset:
        runtime.state.attention_work.update(computed=0, skipped=0)
    return done


def record_work(computed, area):
    """A kernel computed `computed` of a block's `area` query-key pairs (and skipped the rest)."""
    runtime.state.attention_work["computed"] += computed
    runtime.state.attention_work["skipped"] += area - computed


@dataclass(frozen=True)
class Documents:
    """Per token of the global sequence ([batch, seq_len] int64, numpy): the [start, end) of its document.

    `causal_only`: built from Paddle's causal start-row indices, which say where a
    key stops being seen but not where it starts, so it needs is_causal=True.
    """

    start: np.ndarray
    end: np.ndarray
    causal_only: bool = False

    @classmethod
    def from_ids(cls, doc_ids):
        """Documents as runs of equal ids (e.g. [0,0,0,1,1,2,...]) along each row."""
        ids = _as_rows(doc_ids, "document ids")
        new = np.ones(ids.shape, bool)
        new[:, 1:] = ids[:, 1:] != ids[:, :-1]
        return cls._from_starts(new)

    @classmethod
    def from_position_ids(cls, position_ids):
        """Documents that start wherever the position ids restart at 0 (packed sequences)."""
        pos = _as_rows(position_ids, "position ids")
        new = pos == 0
        new[:, 0] = True
        return cls._from_starts(new)

    @classmethod
    def from_startend_row_indices(cls, indices):
        """PaddleFormers' causal `attn_mask_startend_row_indices` ([b, 1, s] or [b, 1, s, 1]):
        key j is seen by rows j <= i < indices[j]."""
        array = _numpy(indices)
        if array.ndim == 4 and array.shape[-1] == 1:
            array = array[..., 0]
        if array.ndim != 3 or array.shape[1] != 1:
            raise ValueError(
                f"attn_mask_startend_row_indices of shape {list(array.shape)} is not supported under context "
                "parallelism: only the causal form [batch, 1, seq] (or [batch, 1, seq, 1]) is; pass a dense "
                "[batch, 1, seq, seq] attention_mask for other masks"
            )
        end = array[:, 0].astype(np.int64)
        return cls(np.zeros_like(end), end, causal_only=True)

    @classmethod
    def _from_starts(cls, new):
        length = new.shape[1]
        index = np.broadcast_to(np.arange(length), new.shape)
        start = np.maximum.accumulate(np.where(new, index, 0), axis=1)
        last = np.ones(new.shape, bool)
        last[:, :-1] = new[:, 1:]
        end = np.minimum.accumulate(np.where(last, index + 1, length)[:, ::-1], axis=1)[:, ::-1]
        return cls(start.astype(np.int64), np.ascontiguousarray(end, dtype=np.int64))

    @property
    def seq_len(self):
        return self.start.shape[1]

    def keys_seen(self):
        """int64 [batch, seq_len]: the keys each query sees under causal attention (key j is seen by
        rows j <= i < end[j]), the work the documents layout balances."""
        batch, length = self.end.shape
        keys = np.broadcast_to(np.arange(length), (batch, length))
        row = np.broadcast_to(np.arange(batch)[:, None] * (length + 1), (batch, length))
        end = np.clip(self.end, 0, length)
        seen = end > keys
        changes = np.zeros(batch * (length + 1), np.int64)  # +1 where a key starts being seen, -1 where it stops
        np.add.at(changes, (row + keys)[seen], 1)
        np.add.at(changes, (row + end)[seen], -1)
        return np.cumsum(changes.reshape(batch, length + 1), axis=1)[:, :length]


def tiles(row_runs, size=None, fragment=0):
    """Index ranges to compute over: runs cut into tiles of at most `size` rows (None: whole), and
    consecutive runs shorter than `fragment` gathered into shared tiles of about `fragment` rows (a
    layout of many short pieces would otherwise make many tiny tiles; masks keep them exact)."""
    out, pending = [], None

    def emit(start, end):
        step = size or end - start
        out.extend((a, min(a + step, end)) for a in range(start, end, step))

    for start, end in row_runs:
        if end - start >= fragment:
            if pending:
                emit(*pending)
                pending = None
            emit(start, end)
            continue
        pending = (pending[0] if pending else start, end)
        if pending[1] - pending[0] >= fragment:
            emit(*pending)
            pending = None
    if pending:
        emit(*pending)
    return out


def _numpy(values):
    return np.asarray(values.numpy() if isinstance(values, paddle.Tensor) else values)


def _as_rows(values, what):
    array = _numpy(values)
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2:
        raise ValueError(f"{what} must be [batch, seq_len] (or [seq_len]), got shape {list(array.shape)}")
    return array


class Extent(NamedTuple):
    """The part of a (queries x keys) block anyone sees: rows [r0, r1) and keys [k0, k1) (local indices), and
    its kind: 'none' (empty), 'all' (every row sees every key), 'diagonal' (plain causal over identical
    positions) or 'some'. One kernel call covers it."""

    rows: tuple
    keys: tuple
    kind: str

    @property
    def area(self):
        return (self.rows[1] - self.rows[0]) * (self.keys[1] - self.keys[0])


def seeing_positions(k_pos, causal, documents=None, window=None, valid=None):
    """(lo, hi), int64 [b or 1, len(k_pos)]: the global query positions lo <= i < hi that see each key at
    `k_pos` by causality, documents, window and padding (a dense mask may hide more)."""
    k_pos = np.asarray(k_pos)
    if documents is not None and documents.causal_only and not causal:
        raise ValueError("attn_mask_startend_row_indices describe a causal mask: call attention with is_causal=True")
    far = np.iinfo(np.int64).max
    if documents is None:
        lo = (k_pos if causal else np.zeros_like(k_pos))[None]
        hi = np.full((1, len(k_pos)), far)
    else:
        lo = k_pos[None] if causal else documents.start[:, k_pos]
        hi = documents.end[:, k_pos]
    if window is not None:
        if not causal:
            raise ValueError("a sliding window is causal (query i sees keys i-w < j <= i): call with is_causal=True")
        hi = np.minimum(hi, k_pos + window)
    if valid is not None:
        seen = np.asarray(valid, bool)[:, k_pos]
        lo, hi = np.where(seen, lo, far), np.where(seen, hi, 0)
    return np.broadcast_arrays(lo, hi)


class BlockMask:
    """Visibility between queries at `q_pos` (ascending) and keys at `k_pos` (global positions).

    `dense`: this pair's slice of a dense mask, [b, 1 or heads, len(q_pos), len(k_pos)],
    boolean (True = attend) or additive (-inf or a dtype's min = masked).
    `cuts`: positions where tiles must start (the layout's chunk starts);
    `fragment`: runs shorter than this share tiles (see `tiles`; 0: every run its own).
    `window`: causal sliding window (a key is seen by itself and the w-1 queries after it);
    `valid`: [b, seq_len] bool over global positions, False for padding keys.

    Query positions ascend, so the rows that see key j are one range [start[j], end[j]) (empty:
    start == end): the whole plan, computed at once with two searchsorted calls. Built once per batch
    (ring.RingMasks, cached by the layout) and read by every layer; what the kernels derive from it
    (the block's extent, the blockwise tiles, the device copies) is kept here too.
    """

    def __init__(self, q_pos, k_pos, causal, documents=None, dense=None, cuts=(), window=None, valid=None,
                 fragment=0):
        self.q_pos, self.k_pos = np.asarray(q_pos), np.asarray(k_pos)
        if np.any(np.diff(self.q_pos) <= 0):
            raise ValueError("a rank's query positions must ascend (every sequence layout holds them in order)")
        self.cuts, self.fragment = cuts, fragment
        self.causal, self.dense, self.window = causal, dense, window
        lo, hi = seeing_positions(self.k_pos, causal, documents, window, valid)
        # int64 [b or 1, sk]: the rows that see each key
        self.start = np.searchsorted(self.q_pos, lo)
        self.end = np.maximum(np.searchsorted(self.q_pos, hi), self.start)
        self.restricted = causal or documents is not None or dense is not None or valid is not None
        self._seen = self._extent = self._bounds = None
        self._tile_plans, self._row_indices = {}, {}

    def q_runs(self):
        return runs(self.q_pos, self.cuts)

    def k_runs(self):
        return runs(self.k_pos, self.cuts)

    def q_tiles(self, size=None):
        return tiles(self.q_runs(), size, self.fragment)

    def k_tiles(self, size=None):
        return tiles(self.k_runs(), size, self.fragment)

    def classify(self, q_range, k_range, record=False):
        """'none', 'all', 'diagonal' (plain causal, same positions) or 'some' for a tile of
        consecutive query rows and consecutive key rows."""
        kind = self._classify(q_range, k_range)
        if record:
            area = (q_range[1] - q_range[0]) * (k_range[1] - k_range[0])
            record_work(0 if kind == "none" else area, area)
        return kind

    def _classify(self, q_range, k_range):
        if not self.restricted:
            return "all"
        (qs, qe), (ks, ke) = q_range, k_range
        start, end = self.start[:, ks:ke], self.end[:, ks:ke]
        if not np.any(np.minimum(end, qe) > np.maximum(start, qs)):
            return "none"
        every = start.max() <= qs and end.min() >= qe
        if self.dense is not None:
            seen = self._dense_seen()[:, :, qs:qe, ks:ke]
            if not seen.any():
                return "none"
            return "all" if every and seen.all() else "some"
        if every:
            return "all"
        diagonal = (self.causal and qe - qs == ke - ks and end.min() >= qe
                    and np.array_equal(self.q_pos[qs:qe], self.k_pos[ks:ke])
                    and np.all(start == np.arange(qs, qe)))
        return "diagonal" if diagonal else "some"

    def extent(self):
        """The block's Extent: the rows and keys anyone sees, trimmed, and their kind."""
        if self._extent is None:
            seen = self.end > self.start  # [b or 1, sk]
            keys = np.flatnonzero(seen.any(axis=0))
            if not len(keys):
                self._extent = Extent((0, 0), (0, 0), "none")
            else:
                rows = (int(self.start[seen].min()), int(self.end[seen].max()))
                span = (int(keys[0]), int(keys[-1]) + 1)
                self._extent = Extent(rows, span, self._classify(rows, span))
        return self._extent

    def row_indices(self, batch):
        """flashmask_attention's startend_row_indices for the extent: int32 [batch, 1, k1 - k0, 2], per key
        (first row that no longer sees it, first row that does), rows counted from r0. Made on the device once."""
        if batch not in self._row_indices:
            (r0, r1), (k0, k1) = self.extent().rows, self.extent().keys
            bounds = np.empty((batch, 1, k1 - k0, 2), np.int32)
            bounds[:, 0, :, 0] = np.clip(self.end[:, k0:k1] - r0, 0, r1 - r0)
            bounds[:, 0, :, 1] = np.clip(self.start[:, k0:k1] - r0, 0, r1 - r0)
            self._row_indices[batch] = paddle.to_tensor(bounds)
        return self._row_indices[batch]

    def tile_plan(self, size):
        """[(q tile, [(k tile, full), ...]), ...] over tiles of at most `size` rows and keys, the tiles no
        query sees left out (`full`: every row sees every key, no mask needed), and the query-key pairs
        computed. Vectorised: each key's rows [start, end) touch one range of query tiles."""
        if size not in self._tile_plans:
            q_tiles, k_tiles = self.q_tiles(size), self.k_tiles(size)
            q_first, q_last = (np.array([t[i] for t in q_tiles]) for i in (0, 1))
            k_first = np.array([t[0] for t in k_tiles])
            seen, full = self._tile_grid(q_first, q_last, k_first)
            if self.dense is not None:  # a dense mask may hide more: its visible pairs, read on the host
                for t, u in zip(*np.nonzero(seen)):
                    kind = self._classify(q_tiles[t], k_tiles[u])
                    seen[t, u], full[t, u] = kind != "none", kind == "all"
            sizes = (q_last - q_first)[:, None] * np.diff(np.append(k_first, len(self.k_pos)))[None]
            plan = [(q_tiles[t], [(k_tiles[u], bool(full[t, u])) for u in np.flatnonzero(seen[t])])
                    for t in range(len(q_tiles))]
            self._tile_plans[size] = (plan, int(sizes[seen].sum()))
        return self._tile_plans[size]

    def _tile_grid(self, q_first, q_last, k_first):
        """bool [q tiles, k tiles] each: some row of the q tile sees some key of the k tile; every row sees
        every key."""
        n_q, n_k = len(q_first), len(k_first)
        key_tile = np.searchsorted(k_first, np.arange(len(self.k_pos)), side="right") - 1
        batch_row, key = np.nonzero(self.end > self.start)
        first = np.searchsorted(q_first, self.start[batch_row, key], side="right") - 1
        last = np.searchsorted(q_first, self.end[batch_row, key] - 1, side="right") - 1
        # +1 where a key's range of q tiles begins, -1 after it ends; summed along the q tiles
        flat = key_tile[key] * (n_q + 1)
        edges = (np.bincount(flat + first, minlength=n_k * (n_q + 1))
                 - np.bincount(flat + last + 1, minlength=n_k * (n_q + 1)))
        seen = (np.cumsum(edges.reshape(n_k, n_q + 1), axis=1)[:, :n_q] > 0).T
        latest_start = np.maximum.reduceat(self.start.max(axis=0), k_first)
        earliest_end = np.minimum.reduceat(self.end.min(axis=0), k_first)
        full = (latest_start[None] <= q_first[:, None]) & (earliest_end[None] >= q_last[:, None])
        return seen, full & seen

    def _dense_seen(self):
        """The dense mask's visible pairs on the host, read once per block (its only device read)."""
        if self._seen is None:
            seen = self.dense if self.dense.dtype == paddle.bool else self.dense > MASKED_BELOW
            self._seen = seen.numpy()
        return self._seen

    def _dense_tile(self, q_range, k_range):
        (qs, qe), (ks, ke) = q_range, k_range
        return self.dense[:, :, qs:qe, ks:ke]

    def tile(self, q_range, k_range):
        """[b or 1, 1 or heads, Bq, Bk] mask for a tile: boolean, or additive when the dense mask is; made on the
        device from the row bounds, copied there once per block."""
        (qs, qe), (ks, ke) = q_range, k_range
        if self._bounds is None:
            self._bounds = [paddle.to_tensor(x) for x in (self.start, self.end)]
        start, end = (x[:, ks:ke].unsqueeze(1) for x in self._bounds)  # [b or 1, 1, Bk]
        rows = paddle.arange(qs, qe, dtype="int64").unsqueeze(-1)  # [Bq, 1]
        visible = ((start <= rows) & (rows < end)).unsqueeze(1)
        if self.dense is None:
            return visible
        tile = self._dense_tile(q_range, k_range)
        if tile.dtype == paddle.bool:
            return paddle.logical_and(tile, visible)
        return paddle.where(visible, tile, paddle.full([], float("-inf"), tile.dtype))
