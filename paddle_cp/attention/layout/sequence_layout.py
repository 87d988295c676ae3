"""Sequence layouts: which global tokens each context-parallel rank holds.

The backend fixes the shape: the `sep` ranks form R ring groups of U Ulysses
ranks (rank index = g*U + u); `p2p` is U = 1, `all2all` is R = 1, `hybrid`
anything between. A split, chosen apart from it, says which positions each ring
group holds; a group's positions are split contiguously over its U ranks.

- `chunks` (ChunkSplit): group g holds chunks g and 2R-1-g of 2R (Paddle's
  shard_seq_load_balance: equal causal work for one document). Any length >=
  ranks works: chunk sizes differ by at most one token, and the extra tokens go
  one per rank before any rank gets a second, so local lengths differ by at most one.
- `documents` (DocumentSplit): one batch's packed documents in the layout a
  GPU would finish first by the tile model (packed_layout.py: of 2R chunks,
  equal query-key pairs, whole documents and mixes, the cheapest slowest rank
  within 1.05 x S/R tokens per ring group); the chunks when they are that one.

PrepareContextParallel picks the split per batch (`SPLITS`); input splitting,
unsharding and the attention all read the batch's layout from here.
"""
from __future__ import annotations

import copy

import numpy as np
import paddle

from ...cost.balance import piece_starts
from ...cost.links import LinkCost
from ...cost.packed_layout import choose, chunk_sizes
from .batch_plans import BatchPlans

BACKENDS = ("p2p", "all2all", "hybrid")
SPLITS = ("documents", "chunks")  # PrepareContextParallel(layout=...): how a batch with documents is split


def check_split(name):
    if name not in SPLITS:
        raise ValueError(f"unknown sequence layout {name!r}: use one of {list(SPLITS)} ('documents' balances packed "
                         "documents' attention work over the ranks, 'chunks' always cuts 2N equal chunks)")
    return name


def check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"unknown context-parallel backend {backend!r}: use one of {list(BACKENDS)}")
    return backend


def ulysses_size(backend, world, ulysses_degree=None):
    """U for a backend over `world` ranks, with a clear error for a bad degree."""
    check_backend(backend)
    if backend != "hybrid":
        if ulysses_degree is not None:
            raise ValueError(f"ulysses_degree is for backend='hybrid'; backend {backend!r} takes none")
        return 1 if backend == "p2p" else world
    if ulysses_degree is None:
        raise ValueError("backend='hybrid' needs ulysses_degree=U (Ulysses inside groups of U ranks, ring across them)")
    if not isinstance(ulysses_degree, int) or ulysses_degree < 1 or (world and world % ulysses_degree):
        raise ValueError(
            f"ulysses_degree={ulysses_degree!r} must be a positive divisor of the {world} context-parallel ranks"
        )
    return ulysses_degree


def even_sizes(total, parts):
    """`total` split into `parts` sizes differing by at most one, larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def runs(positions, cuts=()):
    """(start, end) index ranges over which `positions` count up by one, also cut before any
    position in `cuts` (chunk starts: tiles that stay inside chunks skip cleanly)."""
    breaks = np.flatnonzero((np.diff(positions) != 1) | np.isin(positions[1:], cuts)) + 1
    edges = [0, *breaks.tolist(), len(positions)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


class ChunkSplit:
    """Ring group g holds chunks g and 2R-1-g of 2R, for any sequence."""

    name = "chunks"
    fragment = 0  # every run its own tiles

    def cuts(self, seq_len, ring):
        """Global positions where ring chunks start."""
        return np.cumsum([0] + chunk_sizes(seq_len, ring))[1:-1]

    def group_positions(self, seq_len, ring, index):
        starts = np.cumsum([0] + chunk_sizes(seq_len, ring))
        chunk_ids = (index, 2 * ring - 1 - index)
        return np.concatenate([np.arange(starts[c], starts[c + 1]) for c in chunk_ids])


class DocumentSplit:
    """One batch's positions over R ring groups, as packed_layout.py chose them."""

    name = "documents"
    fragment = 64  # many documents make many short pieces: those share the kernels' tiles

    def __init__(self, group, work, ring):
        """`group`: the ring group of every position; `work`: int64 [batch, seq_len], the keys each query
        sees (Documents.keys_seen: pieces never straddle a document start)."""
        self.seq_len = work.shape[1]
        self.positions = [np.flatnonzero(group == g) for g in range(ring)]
        self._cuts = piece_starts(group, work)

    def _check(self, seq_len):
        if seq_len != self.seq_len:
            raise ValueError(f"this batch's layout covers {self.seq_len} tokens, not {seq_len}: split tensors of "
                             "the batch whose documents made it")

    def cuts(self, seq_len, ring):
        self._check(seq_len)
        return self._cuts

    def group_positions(self, seq_len, ring, index):
        self._check(seq_len)
        return self.positions[index]


class SequenceLayout:
    """`links`: a link_cost.LinkCost of the ring (the chooser prices each candidate's exchange on it); None:
    every rank on one node at link_cost.Links' default rates."""

    def __init__(self, backend, world, ulysses_degree=None, links=None):
        self.backend = check_backend(backend)
        self.world = world
        self.ulysses = ulysses_size(backend, world, ulysses_degree)
        self.ring = world // self.ulysses
        self.links = links if links is not None else LinkCost(np.zeros(self.ring, np.int64))
        self.split = ChunkSplit()
        self.windows = {}  # this layout's RunWindows by (seq_len, rank, before, after): sequence_windows.py
        self._last_batch = None  # (document ends, layout) of the last batch for_batch chose for
        self.plans = BatchPlans()  # attention's masks per batch (api.py), keyed by the split among other facts

    def for_batch(self, documents, split="documents", joint=None):
        """The layout of a batch: with split 'documents', the one packed_layout.choose prices cheapest
        on a GPU for its `documents` (a Documents, or None), tiles and exchange on `self.links` (with
        `joint`, choose's: the batch's other stage placed around each candidate, both priced); else,
        with no documents, and with a single ring group (Ulysses alone: every rank attends for every
        query), this one (2R chunks)."""
        if check_split(split) == "chunks" or documents is None or self.ring == 1:
            return self
        end = np.clip(documents.end, 0, documents.seq_len)  # all the choice reads (keys_seen derives from it)
        if joint is None and self._last_batch is not None and np.array_equal(self._last_batch[0], end):
            return self._last_batch[1]  # the same batch again (its inputs, then its labels): chosen once
        work = documents.keys_seen()
        chosen, _ = choose(end, work, self.ring, self.ulysses, self.links, joint)
        layout = self
        if chosen.name != "chunks":
            layout = copy.copy(self)
            layout.split, layout.windows, layout._last_batch = DocumentSplit(chosen.groups, work, self.ring), {}, None
        self._last_batch = (end, layout)
        return layout

    def check_length(self, seq_len, what="sequence"):
        if seq_len < self.world:
            raise ValueError(
                f"{what} length {seq_len} is shorter than the {self.world} context-parallel ranks: "
                f"every rank needs at least one token; use sequences of length >= {self.world} or fewer sep ranks"
            )

    def chunk_starts(self, seq_len):
        """Global positions where the split's pieces start (tiles stay inside them)."""
        return self.split.cuts(seq_len, self.ring)

    def group_positions(self, seq_len, ring_index):
        """Global positions of ring group `ring_index`, ascending (its Ulysses ranks' tokens, in turn)."""
        return self.split.group_positions(seq_len, self.ring, ring_index)

    def positions(self, seq_len, index):
        """Global token positions held by rank `index`, in local order."""
        self.check_length(seq_len)
        group = self.group_positions(seq_len, index // self.ulysses)
        sizes = even_sizes(len(group), self.ulysses)
        start = sum(sizes[: index % self.ulysses])
        return group[start:start + sizes[index % self.ulysses]]

    def lengths(self, seq_len):
        return [len(self.positions(seq_len, r)) for r in range(self.world)]

    def ring_positions(self, seq_len):
        """[global positions of each ring group], in ring order."""
        return [self.group_positions(seq_len, g) for g in range(self.ring)]

    def group_lengths(self, seq_len, ring_index):
        """Local lengths of the Ulysses ranks of ring group `ring_index`."""
        return self.lengths(seq_len)[ring_index * self.ulysses:(ring_index + 1) * self.ulysses]

    def shard(self, x, axis, index):
        """Rank `index`'s part of a full-sequence tensor (one slice per run of consecutive positions)."""
        positions = self.positions(x.shape[axis], index)
        parts = [paddle.slice(x, [axis], [int(positions[a])], [int(positions[b - 1]) + 1]) for a, b in runs(positions)]
        return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=axis)

    def restore_order(self, seq_len):
        """Index that puts the rank-ordered concatenation of all local parts back in token order."""
        order = np.concatenate([self.positions(seq_len, r) for r in range(self.world)])
        return np.argsort(order)
