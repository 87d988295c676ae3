"""Sequence layouts: which global tokens each context-parallel rank holds.

The `sep` ranks form R ring groups of U Ulysses ranks (rank index = g*U + u).
Ring group g holds chunks g and 2R-1-g of 2R (Paddle's shard_seq_load_balance:
equal causal work per group); its tokens are split contiguously over its U
ranks. `p2p` is U = 1, `all2all` is R = 1, `hybrid` anything between.

Any length >= ranks works: chunk sizes differ by at most one token, and the
extra tokens go one per rank before any rank gets a second, so local lengths
differ by at most one. Input splitting, unsharding and the attention all read
the layout from here.
"""
from __future__ import annotations

import numpy as np
import paddle

BACKENDS = ("p2p", "all2all", "hybrid")


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


class SequenceLayout:
    def __init__(self, backend, world, ulysses_degree=None):
        self.backend = check_backend(backend)
        self.world = world
        self.ulysses = ulysses_size(backend, world, ulysses_degree)
        self.ring = world // self.ulysses

    def check_length(self, seq_len, what="sequence"):
        if seq_len < self.world:
            raise ValueError(
                f"{what} length {seq_len} is shorter than the {self.world} context-parallel ranks: "
                f"every rank needs at least one token; use sequences of length >= {self.world} or fewer sep ranks"
            )

    def _chunk_sizes(self, seq_len):
        """Sizes of the 2R ring chunks; extra tokens go to chunks 0..R-1, then 2R-1 down to R."""
        chunks = 2 * self.ring
        order = list(range(self.ring)) + list(range(chunks - 1, self.ring - 1, -1))
        sizes = [seq_len // chunks] * chunks
        for chunk in order[: seq_len % chunks]:
            sizes[chunk] += 1
        return sizes

    def chunk_starts(self, seq_len):
        """Global positions where ring chunks start."""
        return np.cumsum([0] + self._chunk_sizes(seq_len))[1:-1]

    def group_positions(self, seq_len, ring_index):
        """Global positions of ring group `ring_index`, in its order (its Ulysses ranks' tokens, in turn)."""
        sizes = self._chunk_sizes(seq_len)
        starts = np.cumsum([0] + sizes)
        chunk_ids = (ring_index, 2 * self.ring - 1 - ring_index)
        return np.concatenate([np.arange(starts[c], starts[c + 1]) for c in chunk_ids])

    def positions(self, seq_len, index):
        """Global token positions held by rank `index`, in local order."""
        self.check_length(seq_len)
        group = self.group_positions(seq_len, index // self.ulysses)
        sizes = even_sizes(len(group), self.ulysses)
        start = sum(sizes[: index % self.ulysses])
        return group[start:start + sizes[index % self.ulysses]]

    def lengths(self, seq_len):
        return [len(self.positions(seq_len, r)) for r in range(self.world)]

    def shard(self, x, axis, index):
        """Rank `index`'s part of a full-sequence tensor (one slice per run of consecutive positions)."""
        positions = self.positions(x.shape[axis], index)
        parts = [paddle.slice(x, [axis], [int(positions[a])], [int(positions[b - 1]) + 1]) for a, b in runs(positions)]
        return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=axis)

    def restore_order(self, seq_len):
        """Index that puts the rank-ordered concatenation of all local parts back in token order."""
        order = np.concatenate([self.positions(seq_len, r) for r in range(self.world)])
        return np.argsort(order)
