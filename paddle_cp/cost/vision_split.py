"""The vision tower split over a sep group by images, laid out as paddle_cp lays it out (plans/vision_split.py) and
read for the cost model (pure functions, no Paddle): each rank's pieces, the features it receives and sends.

A piece is one temporal patch of an image or a video (its attention, windows and merge windows stay inside it).
The language layout and the pieces placed around it are chosen together, as PrepareContextParallel chooses them
for a vision-language batch: packed_layout.choose over one causal document of the sequence (each item's vision
start token, its features, its vision end token, then the text), each candidate priced with the pieces placed by
cost/vision_layout.py's joint placement (costliest first, where the slowest rank of vision + language + the
exchange ends earliest, then where its tokens are). The pieces are priced as the split prices them (every block's
attention documents by tiles, vision_tower.attention_lengths; the block's matmuls at vision_layout's GEMM rate), the
exchange on one node at Links' default rates (memory has no cluster: the rates move which rank a piece goes to, not
how many patches a rank gets). A rank receives the features of its positions another rank computed, and sends
those it computed for another's positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .links import LinkCost, Links
from .packed_layout import choose
from .vision_layout import Pieces, StageShape, feature_row_ms, joint_placement, piece_ms, rank_of_positions
from .vision_tower import attention_lengths


@dataclass(frozen=True)
class VisionSplit:
    """Per rank of the sep group: `shares[r]`, its pieces (vision_shape.Media of one temporal patch each);
    `received[r]`, `sent[r]`: the features of one sequence it receives and sends in the exchange."""

    shares: tuple
    received: tuple
    sent: tuple

    def busiest(self):
        """The pieces of the rank computing the most patches."""
        return max(self.shares, key=lambda share: sum(piece.patches for piece in share))


def pieces(media):
    """[(item index, piece)]: every temporal patch of each image and video, in the sequence's order."""
    return [(index, item.frames(t, t + 1)) for index, item in enumerate(media) for t in range(item.t)]


def feature_positions(vision, media):
    """int64 [media tokens]: each feature's position in the sequence (after its item's vision start token)."""
    positions, start = [], 0
    for item in media:
        tokens = item.tokens(vision)
        positions.append(np.arange(start + 1, start + 1 + tokens))
        start += tokens + 2
    return np.concatenate(positions) if positions else np.zeros(0, np.int64)


def stages(model, elem):
    """(the tower's StageShape, the decoder's): blocks or layers, attention width, matmul FLOPs a patch or token
    forward + backward, and a feature row's bytes."""
    vision = model.vision
    tower = StageShape(vision.depth, vision.hidden, 3 * vision.block_matmul_flops, vision.out_hidden * elem)
    decoder = StageShape(model.layers, model.heads * model.head_dim,
                         6 * (model.attention_params + model.dense_mlp_params))
    return tower, decoder


def piece_cost(vision, tower, piece):
    """ms of one piece through the tower, as the split prices it (vision_layout.piece_ms)."""
    lengths = {full: attention_lengths(vision, [piece], full) for full in (True, False)}
    documents = [lengths[block in vision.full_blocks or not vision.window] for block in range(vision.depth)]
    return piece_ms(documents, piece.patches, tower)


def split_layout(model, media, seq, ring, ulysses, elem):
    """The VisionSplit of one sequence of `seq` tokens carrying `media` (a tuple) over `ring` x `ulysses` ranks."""
    vision = model.vision
    found = pieces(media)
    tower, decoder = stages(model, elem)
    costs = {}
    for _, piece in found:
        if (piece.h, piece.w) not in costs:
            costs[piece.h, piece.w] = piece_cost(vision, tower, piece)
    sizes = [piece.tokens(vision) for _, piece in found]
    stacked = Pieces(np.array([costs[piece.h, piece.w] for _, piece in found]), np.concatenate([[0], np.cumsum(sizes)]),
                     feature_positions(vision, media), seq)
    ranks = ring * ulysses
    links = LinkCost.of_ranks(np.arange(ring) * ulysses, Links(ranks_per_node=ranks))
    row_ms = feature_row_ms(links, ulysses, tower.row_bytes)
    end = np.full((1, seq), seq)
    work = np.arange(1, seq + 1)[None]  # one causal document: each query sees the keys before it
    chosen, _ = choose(end, work, ring, ulysses, links,
                       lambda groups, counts: joint_placement(stacked, groups, counts, ulysses, decoder, row_ms))
    computed = np.repeat(chosen.placement.rank, sizes)
    owner = rank_of_positions(chosen.groups, ulysses)[stacked.positions]
    moved = computed != owner
    shares = tuple(tuple(piece for (_, piece), rank in zip(found, chosen.placement.rank) if rank == r)
                   for r in range(ranks))
    return VisionSplit(shares, tuple(np.bincount(owner[moved], minlength=ranks).tolist()),
                       tuple(np.bincount(computed[moved], minlength=ranks).tolist()))
