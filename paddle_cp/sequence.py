"""Split a full-sequence tensor the way PrepareContextParallel does, and put it back together."""
from __future__ import annotations

import paddle

from .attention import SequenceLayout, resolve_group
from .comm.autograd import gather_replicated


def _layout(backend, mesh, group):
    group = resolve_group(mesh, group)
    return SequenceLayout(backend, group.size), group


def shard_sequence(x, seq_dim=1, backend="p2p", mesh=None, group=None):
    """This rank's part of `x` (full sequence on dim `seq_dim`), in PrepareContextParallel's layout."""
    layout, group = _layout(backend, mesh, group)
    return layout.shard(x, seq_dim, group.index)


def unshard_sequence(x, seq_dim=1, backend="p2p", mesh=None, group=None):
    """The full tensor, in token order, on every rank; differentiable.

    The consumer is taken to be replicated (every rank computes the same thing
    from the result), so the backward keeps this rank's slice of the gradient.
    """
    layout, group = _layout(backend, mesh, group)
    gathered = gather_replicated(x, group, seq_dim)
    order = layout.restore_order(gathered.shape[seq_dim])
    return paddle.index_select(gathered, paddle.to_tensor(order), axis=seq_dim)


def sequence_positions(seq_len, backend="p2p", mesh=None, group=None):
    """Global positions of this rank's tokens (int64 [s_local]): position ids for RoPE."""
    layout, group = _layout(backend, mesh, group)
    return paddle.to_tensor(layout.positions(seq_len, group.index), dtype="int64")
