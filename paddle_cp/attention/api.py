"""Context-parallel attention with `F.scaled_dot_product_attention`'s arguments.

One algorithm covers all backends: Ulysses inside groups of U ranks, then ring
attention across the R = N/U groups (`p2p`: U = 1, `all2all`: R = 1).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from .. import mesh as mesh_lib
from .layout import SequenceLayout
from .mask import Documents
from .ring import RingMasks, ring_attention_local
from .rotation import check_rotation
from .ulysses import gather_heads, gather_mask_rows, head_split, scatter_heads


@dataclass(frozen=True)
class CPGroups:
    """The sep group and its Ulysses (inner) and ring (outer) parts."""

    sep: mesh_lib.MeshGroup
    ulysses: mesh_lib.MeshGroup
    ring: mesh_lib.MeshGroup


def _alone(group):
    rank = group.ranks[group.index]
    return mesh_lib.MeshGroup((rank,), 0, None)


def resolve_group(mesh=None, group=None):
    """The context-parallel MeshGroup: `group` (MeshGroup or Paddle Group), else the mesh's `sep` slice."""
    if group is not None:
        if isinstance(group, mesh_lib.MeshGroup):
            return group
        return mesh_lib.MeshGroup(tuple(group.ranks), group.rank, group)
    mesh = mesh_lib.resolve_mesh(mesh)
    mesh_lib.require_dim(mesh, "sep", "context parallelism")
    return mesh_lib.mesh_group(mesh, ["sep"], p2p=True)


def resolve_groups(layout, mesh=None, group=None):
    """CPGroups for a layout; hybrid groups come from the mesh (all slices are made collectively)."""
    sep = resolve_group(mesh, group)
    if layout.ulysses == 1:
        return CPGroups(sep, _alone(sep), sep)
    if layout.ring == 1:
        return CPGroups(sep, sep, _alone(sep))
    if group is not None:
        raise ValueError("backend='hybrid' builds its Ulysses and ring groups from the mesh: pass mesh=, not group=")
    mesh = mesh_lib.resolve_mesh(mesh)
    ulysses, ring = mesh_lib.split_dim_groups(mesh, "sep", layout.ulysses)
    return CPGroups(sep, ulysses, ring)


def check_inputs(query, key, value, dropout_p, training):
    if dropout_p and training:
        raise ValueError(
            f"attention dropout ({dropout_p}) is not supported under context parallelism: "
            "set the model's attention dropout to 0 (or call it with training=False)"
        )
    if not (query.ndim == key.ndim == value.ndim == 4):
        raise ValueError(
            f"context-parallel attention takes [batch, seq, heads, head_dim] tensors; got q/k/v with "
            f"{query.ndim}/{key.ndim}/{value.ndim} dims"
        )
    (b, s, hq, d), (bk, sk, hk, dk), vshape = query.shape, key.shape, value.shape
    if list(key.shape) != list(vshape) or (b, s, d) != (bk, sk, dk) or hq % hk:
        raise ValueError(
            f"q, k, v shapes disagree: q {list(query.shape)}, k {list(key.shape)}, v {list(vshape)}; "
            "k and v must match, share q's batch, sequence and head_dim, and have a head count dividing q's"
        )


def check_mask(attn_mask, query, seq_len):
    b, s, hq, _ = query.shape
    shape = list(attn_mask.shape)
    if len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, hq) or shape[2:] != [s, seq_len]:
        raise ValueError(
            f"under context parallelism attn_mask must hold this rank's query rows against all keys: "
            f"[{b} or 1, 1 or {hq}, {s}, {seq_len}], got {shape}; pass the full [b, 1|h, seq, seq] mask "
            "to the layer PrepareContextParallel splits (it keeps each rank's rows)"
        )


def _check_local_length(layout, seq_len, index, local_len):
    expected = len(layout.positions(seq_len, index))
    if expected != local_len:
        raise ValueError(
            f"this rank holds {local_len} tokens but the {layout.backend!r} layout of a {seq_len}-token sequence "
            f"gives it {expected}: split inputs with PrepareContextParallel or paddle_cp.shard_sequence, and pass "
            "seq_len= to the functional attention when the sequence does not divide evenly"
        )


def context_parallel_attention(
    layout, groups, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, training=True,
    scale=None, seq_len=None, documents=None, rotate="ring", kernel=None,
):
    """This rank's output of attention over the global sequence `layout` splits over `groups`."""
    check_inputs(query, key, value, dropout_p, training)
    check_rotation(rotate)
    # The global length: given, else the documents', else an even split (each rank cannot see the others').
    seq_len = seq_len or (documents.seq_len if documents is not None else query.shape[1] * layout.world)
    layout.check_length(seq_len)
    _check_local_length(layout, seq_len, groups.sep.index, query.shape[1])
    if documents is not None and documents.seq_len != seq_len:
        raise ValueError(f"documents cover {documents.seq_len} tokens, the sequence has {seq_len}")
    if attn_mask is not None and is_causal:
        warnings.warn("attn_mask is ignored when is_causal=True (as in Paddle's SDPA)", stacklevel=3)
        attn_mask = None
    if attn_mask is not None:
        check_mask(attn_mask, query, seq_len)
    scale = query.shape[-1] ** -0.5 if scale is None else scale

    ring_index = groups.sep.index // layout.ulysses
    if groups.ulysses.size > 1:
        lengths = layout.lengths(seq_len)[ring_index * layout.ulysses:(ring_index + 1) * layout.ulysses]
        split = head_split(query.shape[2], key.shape[2], groups.ulysses.size)
        if attn_mask is not None:
            attn_mask = gather_mask_rows(attn_mask, groups.ulysses, split, lengths, query.shape[2])
        query, key, value = scatter_heads(query, key, value, groups.ulysses, split, lengths)
    positions = [layout.group_positions(seq_len, g) for g in range(layout.ring)]
    masks = RingMasks(positions, ring_index, bool(is_causal), documents, attn_mask, layout.chunk_starts(seq_len))
    out = ring_attention_local(query, key, value, groups.ring, masks, scale, kernel, rotate)
    if groups.ulysses.size > 1:
        out = gather_heads(out, groups.ulysses, split, lengths)
    return out


def _functional(backend):
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, training=True,
                  scale=None, enable_gqa=True, *, mesh=None, group=None, seq_len=None, doc_ids=None,
                  ulysses_degree=None, rotate="ring"):
        sep = resolve_group(mesh, group)
        layout = SequenceLayout(backend, sep.size, ulysses_degree)
        groups = resolve_groups(layout, mesh, group)
        documents = None if doc_ids is None else Documents.from_ids(np.asarray(doc_ids))
        return context_parallel_attention(layout, groups, query, key, value, attn_mask, dropout_p, is_causal,
                                          training, scale, seq_len, documents, rotate)

    return attention


_FUNCTIONAL_DOC = """{what} over this rank's [b, s_local, h, d] shards in the {backend!r} layout.

Takes F.scaled_dot_product_attention's arguments plus `mesh` (its `sep` dim) or
`group`. `seq_len`: the global length, needed when it does not divide evenly
(and no `doc_ids` give it);
`doc_ids` ([b, seq_len], global): attention stays inside each document;
`attn_mask`: this rank's rows against all keys, [b, 1|h, s_local, seq_len];
`rotate`: 'ring' or 'allgather' k/v exchange. Returns this rank's output."""

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
