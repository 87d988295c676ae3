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
from ..attention.dispatch.lengths import agreed_seq_len, held_lengths
from ..comm.autograd import gather_replicated
from .. import mesh as mesh_lib
from ..plans.context_parallel import Pool, PrepareContextParallel


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


def _pool(plan, mesh, group):
    """The Pool of a PrepareContextParallel(pool=True) given to shard_sequence / unshard_sequence, else None."""
    if not getattr(plan, "pool", False):
        return None
    if group is not None:
        raise ValueError("a PrepareContextParallel(pool=True) splits over its mesh's dp x sep ranks: pass mesh=, not group=")
    return Pool(plan, mesh_lib.dims_of(mesh))


def shard_sequence(x, seq_dim=1, backend="p2p", mesh=None, group=None, ulysses_degree=None, *, position_ids=None,
                   doc_ids=None, attn_mask_startend_row_indices=None):
    """This rank's part of `x` (full sequence on dim `seq_dim`), in PrepareContextParallel's layout. Under a
    PrepareContextParallel(pool=True), `x` is a [batch, seq, ...] tensor of the global batch and the part
    [1, this rank's tokens, ...] of its rows joined (the model's inputs' split)."""
    pool = _pool(backend, mesh, group)
    if pool is not None:
        batch = pool.shard_batch(x.shape[0], x.shape[seq_dim], backend.documents_of(
            position_ids, doc_ids, attn_mask_startend_row_indices))
        record_shard(batch)  # the batch's forward checks that its inputs are split alike
        return batch.layout.shard(pool.joined(x, x.shape[0], seq_dim), 1, pool.index)
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
    pool = _pool(backend, mesh, group)
    if pool is not None:
        return _unshard_pool(pool, x, seq_dim, seq_len, backend.documents_of(position_ids, doc_ids,
                                                                             attn_mask_startend_row_indices))
    batch = _batch(backend, ulysses_degree, mesh, group, seq_len, position_ids=position_ids, doc_ids=doc_ids,
                   attn_mask_startend_row_indices=attn_mask_startend_row_indices)
    layout, group = batch.layout, batch.group
    seq_len = agreed_seq_len(layout, group, x.shape[seq_dim], seq_len, seq_dim)
    lengths = layout.lengths(seq_len)
    gathered = gather_replicated(x, group, seq_dim, lengths)
    return paddle.index_select(gathered, paddle.to_tensor(layout.restore_order(seq_len)), axis=seq_dim)


def _unshard_pool(pool, x, seq_dim, seq_len, documents):
    """The [batch, seq_len, ...] global batch from each pool rank's [1, tokens, ...] part of its joined rows."""
    if seq_dim != 1 or seq_len is None:
        raise ValueError("unshard_sequence under PrepareContextParallel(pool=True) puts the global batch's rows back: "
                         "give seq_dim=1 and seq_len=<tokens a row of the global batch>")
    held = held_lengths(x.shape[1], pool.groups.sep)
    batch = sum(held) // seq_len
    layout = pool.shard_batch(batch, seq_len, documents).layout if batch * seq_len == sum(held) else None
    if layout is None or layout.lengths(batch * seq_len) != held:
        raise ValueError(f"the pool's ranks hold {held} tokens, which no global batch of rows of {seq_len} tokens "
                         "splits so: pass the seq_len and the document inputs the tensor was split with")
    gathered = gather_replicated(x, pool.groups.sep, 1, held)  # [1, batch x seq_len, ...], rank after rank
    joined = paddle.index_select(gathered, paddle.to_tensor(layout.restore_order(batch * seq_len)), axis=1)
    return joined.reshape([batch, seq_len, *joined.shape[2:]])


def sequence_positions(seq_len, backend="p2p", mesh=None, group=None, ulysses_degree=None, *, position_ids=None,
                       doc_ids=None, attn_mask_startend_row_indices=None):
    """Global positions of this rank's tokens (int64 [s_local]): position ids for RoPE."""
    if getattr(backend, "pool", False):
        raise ValueError("PrepareContextParallel(pool=True) gives the model each token's position in its row itself: "
                         "pass no position ids, or the global batch's [batch, seq] position_ids to the model")
    batch = _batch(backend, ulysses_degree, mesh, group, seq_len, position_ids=position_ids, doc_ids=doc_ids,
                   attn_mask_startend_row_indices=attn_mask_startend_row_indices)
    return paddle.to_tensor(batch.layout.positions(seq_len, batch.group.index), dtype="int64")
