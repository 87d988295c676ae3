"""Context-parallel attention with `F.scaled_dot_product_attention`'s arguments.

One algorithm covers all backends: Ulysses inside groups of U ranks, then ring
attention across the R = N/U groups (`p2p`: U = 1, `all2all`: R = 1).
"""
from __future__ import annotations

import warnings

import numpy as np

from .groups import resolve_group, resolve_groups
from ..layout.sequence_layout import SequenceLayout
from .lengths import agreed_seq_len
from ..masks.block_mask import Documents
from ..masks.mask import Mask
from ..algorithms.ring import RingMasks, ring_attention_local
from ..algorithms.rotation import check_rotation
from ..algorithms.ulysses import gather_heads, gather_mask_rows, head_split, scatter_heads
from .validation import check_inputs, check_local_length, check_mask, check_padding, check_sinks, check_window


def context_parallel_attention(
    layout, groups, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, training=True,
    scale=None, seq_len=None, documents=None, rotate="planned", *, enable_gqa=True, window=None, sinks=None,
    valid=None,
):
    """This rank's output of attention over the global sequence `layout` splits over `groups`.

    `window`: causal sliding window; `sinks`: [hq] per-head logits in every softmax denominator;
    `valid`: [b, seq_len] bool (numpy), False for padding keys no query sees.
    """
    check_inputs(query, key, value, dropout_p, training, enable_gqa)
    mask = call_mask(attn_mask, is_causal, window).of_batch(documents, valid)
    # The global length: given, else the documents', else an even split (the functional APIs agree on it first).
    seq_len = seq_len or (documents.seq_len if documents is not None else query.shape[1] * layout.world)
    return attend(layout, groups, query, key, value, mask, seq_len, scale, rotate, sinks)


def call_mask(attn_mask, is_causal, window=None):
    """The Mask an SDPA-style call asks for (its batch's documents and padding added by `Mask.of_batch`)."""
    check_window(window, is_causal)
    if attn_mask is not None and is_causal:
        warnings.warn("attn_mask is ignored when is_causal=True (as in Paddle's SDPA)", stacklevel=4)
        attn_mask = None
    return Mask(bool(is_causal), window, dense=attn_mask)


def attend(layout, groups, query, key, value, mask, seq_len, scale=None, rotate="planned", sinks=None):
    """Attention of this rank's [b, s_local, h, d] q/k/v (checked by check_inputs) under `mask` (a Mask)
    over the `seq_len` tokens `layout` splits over `groups`: Ulysses inside groups, then the ring."""
    check_rotation(rotate)
    check_sinks(sinks, query)
    layout.check_length(seq_len)
    check_local_length(layout, seq_len, groups.sep.index, query.shape[1])
    check_padding(mask.valid, query.shape[0], seq_len)
    if mask.documents is not None and mask.documents.seq_len != seq_len:
        raise ValueError(f"documents cover {mask.documents.seq_len} tokens, the sequence has {seq_len}")
    if mask.dense is not None:
        check_mask(mask.dense, query, seq_len)
    scale = query.shape[-1] ** -0.5 if scale is None else scale

    ring_index = groups.sep.index // layout.ulysses
    if groups.ulysses.size > 1:
        lengths = layout.group_lengths(seq_len, ring_index)
        split = head_split(query.shape[2], key.shape[2], groups.ulysses.size)
        if mask.dense is not None:
            mask = mask.with_dense(gather_mask_rows(mask.dense, groups.ulysses, split, lengths, query.shape[2]))
        if sinks is not None:
            start = sum(split.q_counts[:groups.ulysses.index])  # this rank's query heads after the trade
            sinks = sinks[start:start + split.q_counts[groups.ulysses.index]]
        query, key, value = scatter_heads(query, key, value, groups.ulysses, split, lengths)
    masks = ring_masks(layout, seq_len, ring_index, mask)
    out = ring_attention_local(query, key, value, groups.ring, masks, scale, rotate, sinks)
    if groups.ulysses.size > 1:
        out = gather_heads(out, groups.ulysses, split, lengths)
    return out


def ring_masks(layout, seq_len, ring_index, mask):
    """The RingMasks of ring group `ring_index`'s queries for a batch: made by its first layer and read by the
    others from `layout.plans`; a dense mask is a layer's tensor, so masks with one are made per call, sharing
    the batch's exchange plan (which does not read it)."""
    def make():
        return RingMasks(layout.ring_positions(seq_len), ring_index, mask.without_dense(),
                         layout.chunk_starts(seq_len), layout.split.fragment)

    masks = layout.plans.get((layout.split, seq_len, ring_index, *mask.batch_facts()), make)
    return masks if mask.dense is None else masks.with_dense(mask.dense)


def _functional(backend):
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, training=True,
                  scale=None, enable_gqa=True, *, mesh=None, group=None, seq_len=None, doc_ids=None,
                  ulysses_degree=None, rotate="planned", window=None, sinks=None):
        sep = resolve_group(mesh, group)
        layout = SequenceLayout(backend, sep.size, ulysses_degree)
        groups = resolve_groups(layout, mesh, group)
        documents = None if doc_ids is None else Documents.from_ids(np.asarray(doc_ids))
        if seq_len is None and documents is None:  # each rank sees only its shard: ask the others
            seq_len = agreed_seq_len(layout, sep, query.shape[1])
        return context_parallel_attention(layout, groups, query, key, value, attn_mask, dropout_p, is_causal,
                                          training, scale, seq_len, documents, rotate, enable_gqa=enable_gqa,
                                          window=window, sinks=sinks)

    return attention


_FUNCTIONAL_DOC = """{what} over this rank's [b, s_local, h, d] shards in the {backend!r} layout.

Takes F.scaled_dot_product_attention's arguments plus `mesh` (its `sep` dim) or
`group`. `seq_len`: the global length; without it (and without `doc_ids`)
the ranks exchange their local lengths (one tiny all-gather), and shards that
do not form the layout raise the same error on every rank;
`doc_ids` ([b, seq_len], global): attention stays inside each document;
`attn_mask`: this rank's rows against all keys, [b, 1|h, s_local, seq_len];
`rotate`: how ring members exchange k/v, 'planned' (only the rows a member's tiles read) or
'allgather' (whole blocks in one collective); `window`: causal sliding window
(query i sees keys i-window < j <= i; tiles outside it are skipped); `sinks`:
[heads] logits in every softmax denominator (gpt-oss). v's head dim may differ
from q/k's (MLA). Returns this rank's output."""

ring_attention = _functional("p2p")
ring_attention.__name__ = "ring_attention"
ring_attention.__doc__ = _FUNCTIONAL_DOC.format(what="Ring attention", backend="p2p")

ulysses_attention = _functional("all2all")
ulysses_attention.__name__ = "ulysses_attention"
ulysses_attention.__doc__ = _FUNCTIONAL_DOC.format(what="Ulysses attention", backend="all2all")

hybrid_attention = _functional("hybrid")
hybrid_attention.__name__ = "hybrid_attention"
hybrid_attention.__doc__ = _FUNCTIONAL_DOC.format(
    what="Ulysses inside groups of `ulysses_degree` ranks, ring across them,", backend="hybrid")
