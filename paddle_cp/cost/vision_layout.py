"""Where a vision-language batch's vision work runs: its pieces placed on the ranks together with the language
model's layout, priced on a GPU (numpy only).

A piece is one temporal patch of an image or a video (every PaddleFormers family's vision tower attends within
one: `cu_seqlens` per frame), its h x w patches merged into h x w / merge^2 language tokens. Each piece runs
whole on one rank (its attention, its windows and its merge windows stay there); its features go to the ranks
that hold its tokens in the language model's layout, in one exchange, forward and (their gradients) backward.

Priced per rank, forward + backward, as the language layout is (cost/tiles.py's H200 fit):
- vision: every block's attention over each of its pieces, a non-causal document of its patches (Qwen2.5-VL's
  windowed blocks: one document per window), in 128 x 128 tiles (full, and partial at a document's edges),
  scaled by the tower's width over the fit's 32 x 128; plus the blocks' matmuls, patches x their FLOPs;
- language: the chosen candidate's ring tiles and exchange on the links (cost/links.py) times the decoder's
  layers, scaled by its width; plus its matmuls, tokens x their FLOPs;
- the feature exchange: the bytes each rank receives (features of its tokens another rank computed, and in
  backward the gradients of the features it computed for others), on the links they come over.
Matmuls at GEMM_TFLOPS, the bf16 GEMM rate measured on the H200 (695-772 at Llama-8B shapes).

The exchange between the stages waits for every rank (forward: the language model needs its tokens' features;
backward: the tower needs theirs), so a step costs the slowest rank's vision, then the slowest exchange, then
the slowest rank's language work, each stage balanced on its own: the language layout's candidates are priced
with the pieces placed for each (the exchange they cause depends on which rank holds which token), and the
cheapest total wins. The placement: the pieces, costliest first, each where the slowest vision rank plus the
slowest exchange ends earliest; of those, on the rank whose vision ends earliest (LPT), then on the rank
holding most of its tokens: a piece goes where its tokens are when that costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tiles import FIT_HEAD_DIM, FIT_HEADS, FULL_MS, PARTIAL_MS, TILE

GEMM_TFLOPS = 700.0  # bf16 GEMM on an H200 (gpu/README.md: 695-772 at Llama-8B shapes)
NEAR_MS = 1e-6  # placements within this of the best count as equal (then: the rank holding most tokens)


@dataclass(frozen=True)
class StageShape:
    """What prices one stage's work: its layers, their attention width (query heads x head dim), each token's
    matmul FLOPs a layer (forward + backward), and the bytes of one token's output a rank sends on."""

    layers: int
    attention_width: int
    matmul_flops: float
    row_bytes: int = 0

    @property
    def head_scale(self):
        return self.attention_width / (FIT_HEADS * FIT_HEAD_DIM)

    def matmul_ms(self, tokens):
        return np.asarray(tokens, dtype=np.float64) * self.layers * self.matmul_flops / (GEMM_TFLOPS * 1e9)


def document_tile_ms(lengths):
    """Forward + backward ms of non-causal attention over documents of `lengths` tokens, fit shape: a document's
    full tiles, and its partial ones at the edge where it ends inside a tile."""
    lengths = np.asarray(lengths, dtype=np.int64)
    whole, tiles = lengths // TILE, -(-lengths // TILE)
    full = whole * whole
    return float(FULL_MS * full.sum() + PARTIAL_MS * (tiles * tiles - full).sum())


def piece_ms(documents_per_block, patches, vision):
    """ms of one piece through the tower: `documents_per_block`, the document lengths its attention sees in each
    block (one block per entry), `patches` its patch count."""
    attention = sum(document_tile_ms(lengths) for lengths in documents_per_block) * vision.head_scale
    return attention + float(vision.matmul_ms(patches))


@dataclass
class VisionPlacement:
    """`rank[k]`: the rank piece k runs on; `vision_ms`, `language_ms`, `exchange_ms`: float [N] per rank;
    `received[r]`: feature rows rank r receives (forward; backward sends as many back)."""

    rank: np.ndarray
    vision_ms: np.ndarray
    language_ms: np.ndarray
    exchange_ms: np.ndarray
    received: np.ndarray

    @property
    def slowest_ms(self):
        """The step's three stages, each waiting for its slowest rank."""
        return float(self.vision_ms.max() + self.exchange_ms.max() + self.language_ms.max())

    @property
    def rows_moved(self):
        return int(self.received.sum())


def place(cost, token_owner_counts, language_ms, row_ms):
    """The VisionPlacement of pieces costing `cost[k]` ms whose tokens rank r holds `token_owner_counts[k, r]` of,
    on ranks whose language work is `language_ms[r]`; `row_ms[r, q]`: ms for rank r to receive one feature row
    from rank q (forward and its gradient backward)."""
    cost = np.asarray(cost, dtype=np.float64)
    owners = np.asarray(token_owner_counts, dtype=np.int64)
    ranks = len(language_ms)
    vision = np.zeros(ranks)
    exchange = np.zeros(ranks)
    received = np.zeros(ranks, np.int64)
    rank = np.zeros(len(cost), np.int64)
    for k in np.argsort(-cost, kind="stable"):
        rows = owners[k]
        incoming = rows[:, None] * row_ms  # [r, q]: ms r spends receiving its rows of k from q
        np.fill_diagonal(incoming, 0.0)
        own = vision + cost[k]  # [q]: q's vision with k on it
        slowest = np.maximum(vision.max(), own) + (exchange[:, None] + incoming).max(axis=0)  # [q]
        best = np.flatnonzero(slowest <= slowest.min() + NEAR_MS)
        best = best[own[best] <= own[best].min() + NEAR_MS]
        q = int(best[np.argmax(rows[best])])
        rank[k] = q
        vision[q] += cost[k]
        exchange += incoming[:, q]
        received += np.where(np.arange(ranks) == q, 0, rows)
    return VisionPlacement(rank, vision, np.asarray(language_ms, dtype=np.float64), exchange, received)


def feature_row_ms(links, ulysses, row_bytes):
    """float [N, N]: ms for rank r to receive one feature row of `row_bytes` from rank q and send its gradient
    back, on the ring's links (a LinkCost of its members, each `ulysses` ranks)."""
    member = np.arange(links.ms_per_byte.shape[0] * ulysses) // ulysses
    return links.ms_per_byte[member[:, None], member[None, :]] * row_bytes * 2


def rank_of_positions(groups, ulysses=1):
    """int [S]: the rank holding each position, its ring group's (`groups[p]`) positions split in order, evenly,
    over the group's `ulysses` ranks (layout/sequence_layout.py's rule)."""
    groups = np.asarray(groups, dtype=np.int64)
    if ulysses == 1:
        return groups
    rank = np.empty_like(groups)
    for g in np.unique(groups):
        where = np.flatnonzero(groups == g)
        sizes = [len(where) // ulysses + (u < len(where) % ulysses) for u in range(ulysses)]
        rank[where] = g * ulysses + np.repeat(np.arange(ulysses), sizes)
    return rank


@dataclass
class Pieces:
    """A batch's vision pieces over a sequence of `seq_len` tokens: `cost[k]` ms, `features[k]:features[k+1]`
    its rows among the features, `positions[i]`: the flat position (row x seq_len + column) feature i lands at."""

    cost: np.ndarray
    features: np.ndarray
    positions: np.ndarray
    seq_len: int

    def owner_counts(self, owner, ranks):
        """int [K, ranks]: how many of each piece's tokens rank r holds, `owner[p]` the rank of position p."""
        held = owner[self.positions % self.seq_len]
        piece = np.repeat(np.arange(len(self.cost)), np.diff(self.features))
        counts = np.zeros((len(self.cost), ranks), np.int64)
        np.add.at(counts, (piece, held), 1)
        return counts


def joint_placement(pieces, groups, counts, ulysses, language, row_ms):
    """The VisionPlacement of `pieces` under a language candidate (`groups`, its TileCounts `counts`) of the
    decoder `language` (a StageShape), on ranks receiving a feature row at `row_ms[r, q]`."""
    owner = rank_of_positions(groups, ulysses)
    ranks = len(counts.tokens) * ulysses
    per_group = counts.rank_ms(ulysses, language.head_scale) * language.layers
    tokens = np.bincount(owner, minlength=ranks)
    language_ms = np.repeat(per_group, ulysses) + language.matmul_ms(tokens)
    return place(pieces.cost, pieces.owner_counts(owner, ranks), language_ms, row_ms)
