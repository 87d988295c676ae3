"""Attention's cost under context parallelism: bytes sent, bytes held, FLOPs (pure functions).

Units: bytes, seconds, FLOPs. Every traffic figure is bytes *sent per rank* for
one forward+backward, the quantity paddle_cp.bytes_sent() counts.

Attention traffic (one attention call; local q [b, s/N, hq, d], k/v [b, s/N, hk, d],
`e` bytes per element, KV = bytes of the local k and v together):
- ring (backend p2p): forward passes k/v N-1 hops; backward passes k/v N-1
  hops again (fetched again instead of every layer holding every block; under
  recomputation the replay's forward passes them and its backward reads those)
  and dk/dv N-1 hops (the owner keeps its own block's gradient until the sum of
  the others' arrives): 3(N-1) KV, the algorithm's minimum.
- Ulysses (backend all2all): all-to-all of q, k, v before and of out after
  attention sends (N-1)/N of each; the backward mirrors it. k/v heads fewer
  than N are repeated before the exchange (that is what travels). This is also
  the minimum for a head split: ratio 1.
- hybrid (USP): Ulysses over U ranks on s/R tokens, then the ring over R = N/U
  groups on the head-split k/v (h_k/U heads, repeated first when h_k < U).
Every figure is the minimum of its algorithm, and what paddle_cp sends with whole blocks (the `allgather`
rotation, or the planned exchange where every tile is read). The planned exchange, paddle_cp's default ring,
sends only the k/v rows other members' tiles read (cost/exchange.py): the planner prices that
(step_time.ring_exchange).

Attention memory: activation bytes a rank holds between forward and backward
(inputs included), the thing context parallelism divides by N:
- single process / ring: q, k, v, out and the fp32 log-sum-exp [b, hq, s].
- Ulysses and hybrid: the same plus the head-split copies of q, k, v, out that
  the local attention saves (k/v heads repeated up to U).

Checked against measurements on CPU (tests/multiproc/test_bench.py): the bytes
exactly, the held memory within 2%. The whole-model cost model is memory.py's and step_time.py's.

Attention time on packed documents is not FLOPs: a GPU pays 128 x 128 tiles, a partial
one (a document boundary inside) about 1.5x a full one. PackedRow prices a row's
attention with the GPU tile model (cost/tiles.py, the H200 fit) in the layout
paddle_cp chooses for it (cost/packed_layout.py), the slowest rank's.
"""
from __future__ import annotations

import numpy as np

from . import packed_layout
from .tiles import FIT_HEAD_DIM, FIT_HEADS

FP32 = 4
LSE_BYTES = FP32  # log-sum-exps are kept in fp32 whatever the input dtype


def kv_heads_sent(heads, kv_heads, ulysses):
    """K/V heads after Ulysses repeats them so every one of `ulysses` ranks gets one: by the
    smallest factor dividing the GQA group that reaches `ulysses` (attention/ulysses.head_split)."""
    group = heads // kv_heads
    return kv_heads * next((t for t in range(1, group + 1) if group % t == 0 and kv_heads * t >= ulysses), group)


def ring_kv_heads(heads, kv_heads, ulysses):
    """K/V heads one rank's ring carries: its 1/`ulysses` share of the heads Ulysses sends (kv_heads_sent)."""
    return kv_heads_sent(heads, kv_heads, ulysses) // ulysses


def ring_bytes(batch, seq, kv_heads, head_dim, ring, elem=FP32):
    """Bytes one rank sends in ring attention forward+backward: k/v N-1 hops forward, k/v (backward, or the
    replay under recomputation) and dk/dv N-1 hops, 3(N-1) KV."""
    kv = 2 * batch * (seq // ring) * kv_heads * head_dim * elem
    return 3 * (ring - 1) * kv


def ulysses_bytes(batch, seq, heads, kv_heads, head_dim, ulysses, elem=FP32):
    """Bytes one rank sends in Ulysses forward+backward: 2 x (N-1)/N of q, k, v, out."""
    if ulysses == 1:
        return 0
    local = batch * (seq // ulysses) * head_dim * elem
    sent_heads = 2 * heads + 2 * kv_heads_sent(heads, kv_heads, ulysses)
    return 2 * (ulysses - 1) * local * sent_heads // ulysses


def attention_traffic(batch, seq, heads, kv_heads, head_dim, ring, ulysses, elem=FP32):
    """(Ulysses bytes, ring bytes) per rank for ring x Ulysses context parallelism.

    Ulysses over `ulysses` ranks gathers the sequence s/ring and splits heads;
    the ring then runs over `ring` groups on the head-split k/v (repeated first
    when there are fewer k/v heads than Ulysses ranks).
    """
    inner = ulysses_bytes(batch, seq // ring, heads, kv_heads, head_dim, ulysses, elem)
    return inner, ring_bytes(batch, seq, ring_kv_heads(heads, kv_heads, ulysses), head_dim, ring, elem)


def degrees(backend, world, ulysses_degree=None):
    """(ring, Ulysses) sizes of `backend` over `world` ranks."""
    if world == 1:
        return 1, 1
    if backend == "p2p":
        return world, 1
    if backend == "all2all":
        return 1, world
    if backend == "hybrid" and ulysses_degree and world % ulysses_degree == 0:
        return world // ulysses_degree, ulysses_degree
    raise ValueError(f"backend {backend!r} over {world} ranks with ulysses_degree={ulysses_degree}: use 'p2p', "
                     "'all2all', or 'hybrid' with a ulysses_degree dividing the ranks")


def attention_bytes(backend, batch, seq, heads, kv_heads, head_dim, world, elem=FP32, ulysses_degree=None):
    """Bytes per rank of `backend` over `world` ranks: the algorithm's minimum, which paddle_cp sends."""
    ring, ulysses = degrees(backend, world, ulysses_degree)
    return sum(attention_traffic(batch, seq, heads, kv_heads, head_dim, ring, ulysses, elem))


def attention_held_bytes(backend, batch, seq, heads, kv_heads, head_dim, world, elem=FP32, ulysses_degree=None):
    """Activation bytes one rank holds between attention forward and backward (inputs included)."""
    _, ulysses = degrees(backend, world, ulysses_degree)
    tokens = batch * seq // world
    qkvo = tokens * (2 * heads + 2 * kv_heads) * head_dim * elem
    lse = tokens * heads * LSE_BYTES
    if ulysses > 1:
        split = tokens * (2 * heads + 2 * kv_heads_sent(heads, kv_heads, ulysses)) * head_dim * elem
        return qkvo + split + lse
    return qkvo + lse


def attention_flops(batch, seq, heads, head_dim, causal):
    """Useful forward+backward FLOPs: 4bhs^2d forward (half if causal), backward 2.5x forward."""
    forward = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return 3.5 * forward


class PackedRow:
    """One row of packed documents and its attention time by the GPU tile model: `end` [1, seq], the row past each
    key's document (attention's Documents.end), and `keys_seen` [1, seq], the keys each query sees (its
    keys_seen())."""

    def __init__(self, end, keys_seen):
        self.end, self.keys_seen = np.asarray(end), np.asarray(keys_seen)
        self._chosen = {}  # (ring, ulysses[, nodes, rates]) -> the chosen layout's TileCounts

    def counts(self, ring, ulysses, links=None):
        """TileCounts of the layout paddle_cp chooses for the row over `ring` groups of `ulysses` ranks, its
        exchange priced on `links` (links.LinkCost, as SequenceLayout prices it; None: one node)."""
        key = (ring, ulysses) if links is None else (ring, ulysses, tuple(links.nodes), links.links)
        if key not in self._chosen:
            chosen, _ = packed_layout.choose(self.end, self.keys_seen, ring, ulysses, links)
            self._chosen[key] = chosen.counts
        return self._chosen[key]

    def seconds(self, ring, ulysses, heads, head_dim, links=None):
        """The slowest rank's attention, forward + backward of one layer, in seconds: its tiles priced at the
        H200 fit, scaled from the fit's 32 query heads of dim 128 to `heads` (a rank's before Ulysses) x `head_dim`."""
        counts = self.counts(ring, ulysses, links)
        return counts.slowest_ms(ulysses, heads * head_dim / (FIT_HEADS * FIT_HEAD_DIM)) / 1e3
