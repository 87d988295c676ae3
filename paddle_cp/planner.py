"""Cost model for choosing a parallel layout: pure functions, no Paddle, no devices.

Units: bytes, seconds, FLOPs. Every traffic figure is bytes *sent per rank* for
one forward+backward, the quantity paddle_cp.bytes_sent() counts.

Attention traffic (one attention call; local q [b, s/N, hq, d], k/v [b, s/N, hk, d],
`e` bytes per element, KV = bytes of the local k and v together):
- ring (backend p2p), as implemented: forward passes k/v N-1 hops; backward
  passes k/v N-1 hops again (recomputation instead of holding every block) and
  dk/dv N hops (each block's gradient starts at its owner and goes all the way
  round): (3N-2) KV. The algorithm's minimum is 3(N-1) KV (dk/dv need only N-1
  hops if each rank handles its own block last); ratio (3N-2)/(3N-3).
- Ulysses (backend all2all): all-to-all of q, k, v before and of out after
  attention sends (N-1)/N of each; the backward mirrors it. k/v heads fewer
  than N are repeated before the exchange (that is what travels). This is also
  the minimum for a head split: ratio 1.
- hybrid (USP): Ulysses over U ranks, then ring over R = N/U groups on h/U heads.

Attention memory: activation bytes a rank holds between forward and backward
(inputs included), the thing context parallelism divides by N:
- single process / ring: q, k, v, out and the fp32 log-sum-exp [b, hq, s].
- Ulysses: the same plus the head-split copies of q, k, v, out that its local
  attention saves.

The whole-model model (`estimate`) adds parameters, gradients and Adam state
(16 bytes per parameter: weights, grads, fp32 master copy or fp32 weights, two
moments), per-layer activations, tensor-parallel all-reduces and the data-parallel
gradient all-reduce (over dp x cp ranks, where gradients are replicated).
It is a model of GPU clusters: only the attention traffic and attention memory
were checked against measurements (on CPU, tests/test_tools.py).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

FP32 = 4
LSE_BYTES = FP32  # log-sum-exps are kept in fp32 whatever the input dtype
ADAM_BYTES_PER_PARAM = 16


# ---- attention: traffic and memory -------------------------------------------------

def kv_heads_sent(kv_heads, ulysses):
    """K/V heads after Ulysses repeats them so every one of `ulysses` ranks gets one."""
    return ulysses if kv_heads < ulysses else kv_heads


def ring_bytes(batch, seq, kv_heads, head_dim, ring, elem=FP32):
    """Bytes one rank sends in ring attention forward+backward, as implemented: (3N-2) KV."""
    if ring == 1:
        return 0
    kv = 2 * batch * (seq // ring) * kv_heads * head_dim * elem
    return (3 * ring - 2) * kv


def ring_min_bytes(batch, seq, kv_heads, head_dim, ring, elem=FP32):
    """The ring algorithm's minimum: k/v N-1 hops forward, k/v and dk/dv N-1 hops backward."""
    kv = 2 * batch * (seq // ring) * kv_heads * head_dim * elem
    return 3 * (ring - 1) * kv


def ulysses_bytes(batch, seq, heads, kv_heads, head_dim, ulysses, elem=FP32):
    """Bytes one rank sends in Ulysses forward+backward: 2 x (N-1)/N of q, k, v, out."""
    if ulysses == 1:
        return 0
    local = batch * (seq // ulysses) * head_dim * elem
    sent_heads = 2 * heads + 2 * kv_heads_sent(kv_heads, ulysses)
    return 2 * (ulysses - 1) * local * sent_heads // ulysses


def attention_bytes(backend, batch, seq, heads, kv_heads, head_dim, world, elem=FP32, ulysses=None):
    """Bytes per rank for `backend` in ('p2p', 'all2all', 'hybrid') over `world` ranks.

    Hybrid: Ulysses over `ulysses` ranks on the sequence s/R, then ring over
    R = world/ulysses on h/ulysses heads (k/v heads repeated first if needed).
    """
    if backend == "p2p":
        return ring_bytes(batch, seq, kv_heads, head_dim, world, elem)
    if backend == "all2all":
        return ulysses_bytes(batch, seq, heads, kv_heads, head_dim, world, elem)
    ring = world // ulysses
    inner = ulysses_bytes(batch, seq // ring, heads, kv_heads, head_dim, ulysses, elem)
    ring_heads = kv_heads_sent(kv_heads, ulysses) // ulysses
    return inner + ring_bytes(batch, seq, ring_heads, head_dim, ring, elem)


def attention_min_bytes(backend, batch, seq, heads, kv_heads, head_dim, world, elem=FP32):
    """The analytic minimum that benchmarks divide measured bytes by."""
    if backend == "p2p":
        return ring_min_bytes(batch, seq, kv_heads, head_dim, world, elem)
    return ulysses_bytes(batch, seq, heads, kv_heads, head_dim, world, elem)


def attention_held_bytes(backend, batch, seq, heads, kv_heads, head_dim, world, elem=FP32):
    """Activation bytes one rank holds between attention forward and backward (inputs included)."""
    tokens = batch * seq // world
    qkvo = tokens * (2 * heads + 2 * kv_heads) * head_dim * elem
    lse = tokens * heads * LSE_BYTES
    if backend == "all2all" and world > 1:
        split = tokens * (2 * heads + 2 * kv_heads_sent(kv_heads, world)) * head_dim * elem
        return qkvo + split + lse
    return qkvo + lse


def attention_flops(batch, seq, heads, head_dim, causal):
    """Useful forward+backward FLOPs: 4bhs^2d forward (half if causal), backward 2.5x forward."""
    forward = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return 3.5 * forward
