"""Sequence layouts: which global tokens each context-parallel rank holds.

`p2p` (balanced ring): the sequence is cut into 2N chunks and rank r keeps chunks
r and 2N-1-r, so causal work is equal on every rank (Paddle's
shard_seq_load_balance). `all2all` (Ulysses): rank r keeps chunk r of N.
Input splitting and the attention both read the layout from here.
"""
from __future__ import annotations

import numpy as np
import paddle

BACKENDS = ("p2p", "all2all")


def check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"unknown context-parallel backend {backend!r}: use one of {list(BACKENDS)}")
    return backend


class SequenceLayout:
    def __init__(self, backend, world):
        self.backend = check_backend(backend)
        self.world = world

    @property
    def chunks(self):
        return 2 * self.world if self.backend == "p2p" else self.world

    def check_length(self, seq_len, what="sequence"):
        if seq_len % self.chunks:
            multiple = self.chunks
            raise ValueError(
                f"{what} length {seq_len} is not divisible by {multiple} "
                f"({'2 x ' if self.backend == 'p2p' else ''}{self.world} context-parallel ranks, backend "
                f"{self.backend!r}): pad the sequence to a multiple of {multiple}"
            )

    def chunk_ids(self, index):
        if self.backend == "p2p":
            return [index, 2 * self.world - 1 - index]
        return [index]

    def positions(self, seq_len, index):
        """Global token positions held by rank `index`, in local order."""
        self.check_length(seq_len)
        size = seq_len // self.chunks
        return np.concatenate([np.arange(c * size, (c + 1) * size) for c in self.chunk_ids(index)])

    def shard(self, x, axis, index):
        """Rank `index`'s part of a full-sequence tensor."""
        seq_len = x.shape[axis]
        self.check_length(seq_len)
        size = seq_len // self.chunks
        parts = [paddle.slice(x, [axis], [c * size], [(c + 1) * size]) for c in self.chunk_ids(index)]
        return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=axis)

    def restore_order(self, seq_len):
        """Index that puts the rank-ordered concatenation of all local parts back in token order."""
        order = np.concatenate([self.positions(seq_len, r) for r in range(self.world)])
        return np.argsort(order)
