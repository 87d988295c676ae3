"""Ulysses attention (backend `all2all`): trade the sequence split for a head split.

All-to-all [b, s/N, h, d] -> [b, s, h/N, d], full-sequence attention on h/N
heads, and back. K/V heads fewer than ranks are repeated so every rank has one.
"""
from __future__ import annotations

from ..comm.autograd import all_to_all
from .kernels import local_attention


def check_heads(q_heads, kv_heads, world):
    if q_heads % world:
        raise ValueError(
            f"Ulysses (backend 'all2all') splits heads over ranks: {q_heads} query heads do not divide over "
            f"{world} ranks; use a sep degree that divides the head count, or backend='p2p'"
        )
    if kv_heads % world and world % kv_heads:
        raise ValueError(
            f"Ulysses needs the {kv_heads} key/value heads to divide over {world} ranks, or {world} ranks over them "
            f"(to repeat each); use a sep degree that divides or is a multiple of {kv_heads}, or backend='p2p'"
        )


def repeat_kv_heads(x, times):
    """[b, s, h, d] -> [b, s, h*times, d], each head repeated in place (Paddle's GQA order)."""
    if times == 1:
        return x
    b, s, h, d = x.shape
    return x.unsqueeze(3).expand([b, s, h, times, d]).reshape([b, s, h * times, d])


def ulysses_attention_local(q, k, v, mesh_group, causal, scale, kernel):
    world = mesh_group.size
    check_heads(q.shape[2], k.shape[2], world)
    if k.shape[2] < world:
        k = repeat_kv_heads(k, world // k.shape[2])
        v = repeat_kv_heads(v, world // v.shape[2])
    q, k, v = (all_to_all(x, mesh_group, scatter_axis=2, gather_axis=1, op="ulysses") for x in (q, k, v))
    out = local_attention(q, k, v, causal, scale, kernel)
    return all_to_all(out, mesh_group, scatter_axis=1, gather_axis=2, op="ulysses")
