"""Split a full-sequence tensor the way PrepareContextParallel does, and put it back together.

`backend` is a backend name (with `ulysses_degree` for 'hybrid') or a
PrepareContextParallel plan, whose exact layout is then followed. A plan that
splits batches by their documents (the default whenever it knows them) needs
the batch's document inputs here too, as the model gets them: `position_ids`
for `documents="position_ids"`, `doc_ids` for a named document-id input,
`attn_mask_startend_row_indices` when the model is given PaddleFormers' row
indices. Called after the batch's forward, it splits in that forward's layout
(its Batch); called before, the forward checks that its inputs are split alike.
"""
from __future__ import annotations

import paddle
import paddle.distributed as dist

from ..attention import SequenceLayout, resolve_group
from ..attention.dispatch.batch import Batch, record_shard
from ..attention.dispatch.lengths import agreed_seq_len
from ..comm.autograd import gather_replicated
from ..plans.context_parallel import PrepareContextParallel


def _batch(backend, ulysses_degree, mesh, group, seq_len, **documents):
    """The Batch whose layout splits a batch's tensors of `seq_len` tokens (None: not known yet) over the sep
    group; `documents`: the document inputs given."""
    group = resolve_group(mesh, group)
    if isinstance(backend, PrepareContextParallel):
        return backend.shard_batch(group, seq_len, **documents)
    if any(value is not None for value in documents.values()):
        given = [name for name, value in documents.items() if value is not None]
        raise ValueError(f"{', '.join(given)} given with backend={backend!r}: the layout of a batch follows its "
                         "documents only under a plan; pass backend=<the PrepareContextParallel plan>")
    if isinstance(backend, dist.PrepareContextParallel):  # Paddle's has no Ulysses degree and no documents
        backend = backend.backend
    return Batch(SequenceLayout(backend, group.size, ulysses_degree), seq_len, group=group)


def shard_sequence(x, seq_dim=1, backend="p2p", mesh=None, group=None, ulysses_degree=None, *, position_ids=None,
                   doc_ids=None, attn_mask_startend_row_indices=None):
    """This rank's part of `x` (full sequence on dim `seq_dim`), in PrepareContextParallel's layout."""
    batch = _batch(backend, ulysses_degree, mesh, group, x.shape[seq_dim], position_ids=position_ids, doc_ids=doc_ids,
                   attn_mask_startend_row_indices=attn_mask_startend_row_indices)
    batch.layout.check_length(x.shape[seq_dim])
    record_shard(batch)  # the batch's forward checks that its inputs are split alike
    return batch.layout.shard(x, seq_dim, batch.group.index)


def unshard_sequence(x, seq_dim=1, backend="p2p", mesh=None, group=None, ulysses_degree=None, seq_len=None, *,
                     position_ids=None, doc_ids=None, attn_mask_startend_row_indices=None):
    """The full tensor, in token order, on every rank; differentiable.

    The ranks first exchange their local lengths (one tiny all-gather), so any
    length works without `seq_len`, and a `seq_len` or a tensor that does not
    fit the layout raises the same error on every rank instead of leaving some
    waiting. The consumer is taken to be replicated (every rank computes the
    same thing from the result), so the backward keeps this rank's slice of the
    gradient.
    """
    batch = _batch(backend, ulysses_degree, mesh, group, seq_len, position_ids=position_ids, doc_ids=doc_ids,
                   attn_mask_startend_row_indices=attn_mask_startend_row_indices)
    layout, group = batch.layout, batch.group
    seq_len = agreed_seq_len(layout, group, x.shape[seq_dim], seq_len, seq_dim)
    lengths = layout.lengths(seq_len)
    gathered = gather_replicated(x, group, seq_dim, lengths)
    return paddle.index_select(gathered, paddle.to_tensor(layout.restore_order(seq_len)), axis=seq_dim)


def sequence_positions(seq_len, backend="p2p", mesh=None, group=None, ulysses_degree=None, *, position_ids=None,
                       doc_ids=None, attn_mask_startend_row_indices=None):
    """Global positions of this rank's tokens (int64 [s_local]): position ids for RoPE."""
    batch = _batch(backend, ulysses_degree, mesh, group, seq_len, position_ids=position_ids, doc_ids=doc_ids,
                   attn_mask_startend_row_indices=attn_mask_startend_row_indices)
    return paddle.to_tensor(batch.layout.positions(seq_len, batch.group.index), dtype="int64")
