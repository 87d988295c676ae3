"""Context-parallel attention with `F.scaled_dot_product_attention`'s arguments."""
from __future__ import annotations

import warnings

from .. import mesh as mesh_lib
from .kernels import select_kernel
from .layout import check_backend
from .ring import ring_attention_local
from .ulysses import ulysses_attention_local

_ALGORITHMS = {"p2p": ring_attention_local, "all2all": ulysses_attention_local}


def resolve_group(mesh=None, group=None):
    """The context-parallel MeshGroup: `group` (MeshGroup or Paddle Group), else the mesh's `sep` slice."""
    if group is not None:
        if isinstance(group, mesh_lib.MeshGroup):
            return group
        return mesh_lib.MeshGroup(tuple(group.ranks), group.rank, group)
    mesh = mesh_lib.resolve_mesh(mesh)
    mesh_lib.require_dim(mesh, "sep", "context parallelism")
    return mesh_lib.mesh_group(mesh, ["sep"], p2p=True)


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


def context_parallel_attention(
    backend, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, training=True,
    scale=None, group=None, kernel=None,
):
    check_backend(backend)
    check_inputs(query, key, value, dropout_p, training)
    if attn_mask is not None:
        if not is_causal:
            raise ValueError(
                "attn_mask is not supported by context-parallel attention yet: express causal masks with "
                "is_causal=True, or run this attention without ContextParallel"
            )
        warnings.warn("attn_mask is ignored when is_causal=True (as in Paddle's SDPA)", stacklevel=3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _ALGORITHMS[backend](query, key, value, group, bool(is_causal), scale, kernel or select_kernel(query))


def _functional(backend):
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, training=True,
                  scale=None, enable_gqa=True, *, mesh=None, group=None):
        group = resolve_group(mesh, group)
        return context_parallel_attention(backend, query, key, value, attn_mask, dropout_p, is_causal,
                                          training, scale, group)

    return attention


ring_attention = _functional("p2p")
ring_attention.__name__ = "ring_attention"
ring_attention.__doc__ = """Ring attention over this rank's [b, s/N, h, d] shards in the `p2p` layout.

Takes F.scaled_dot_product_attention's arguments plus `mesh` (its `sep` dim) or
`group`; returns this rank's part of the output."""

ulysses_attention = _functional("all2all")
ulysses_attention.__name__ = "ulysses_attention"
ulysses_attention.__doc__ = """Ulysses attention over this rank's [b, s/N, h, d] shards in the `all2all` layout.

Takes F.scaled_dot_product_attention's arguments plus `mesh` (its `sep` dim) or
`group`; returns this rank's part of the output."""
