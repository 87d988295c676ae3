"""Vision-language batches laid out over a sep group: the vision tower split by images against the ways others
split it (`pcp-bench --vision`), priced by the GPU cost model (numpy: no GPU and no launch).

    pcp-bench --vision --sep 8 --mixes images video videos pages

Each mix is one packed row of conversations (a document each: text, then its image or video, then text) for
Qwen2.5-VL-7B (pcp-plan's `qwen2.5-vl-7b`: its tower's windows, blocks, merger; its decoder's layers), laid out
over `--sep` ring ranks on one node five ways:
- `paddle_cp`: PrepareContextParallel's choice with the tower split (plans/vision_split.py): every language
  candidate priced with the vision pieces (one temporal patch each) placed around it, the cheapest slowest rank of
  vision + language + the feature exchange (cost/vision_layout.py); each feature sent to its token's rank only;
- `language-first`: the language layout chosen alone (by its tiles), then the pieces placed around it;
- `whole`: the tower whole on every rank (paddle_cp without ContextParallel on the tower; Megatron-Bridge's
  default): every rank computes every piece, nothing is sent;
- `by-count`: each rank a contiguous block of the media by count, every feature all-gathered (Megatron-Bridge's
  `vision_dp_when_cp`);
- `by-cost`: contiguous groups of temporal patches by the cost p(p + a), p the patches of a piece and a the tower's
  hidden size, every feature all-gathered (NeMo Automodel's frame sharding).

Per layout, predicted per rank for forward + backward (tile model and GEMM rate, cost/vision_layout.py):
`vision max/mean` and `vision+lang max/mean` (the slowest rank over the mean), `slowest ms` (the step: the slowest
rank's vision, then the slowest exchange on NVLink, then the slowest rank's language work), `MiB max` and `min MiB` (feature bytes the busiest rank receives, forward, and the
least any placement of that layout's pieces makes it receive: the features of its own tokens another rank
computed), `held/all` (the most features any rank holds, computed or received, over all of them) and `host ms`
(the layout's choice, CPU time of the numpy pricing: on every rank, each batch).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

LAYOUTS = ("paddle_cp", "language-first", "whole", "by-count", "by-cost")
MIXES = ("images", "video", "videos", "pages")
MODEL = "qwen2.5-vl-7b"


@dataclass
class Row:
    """One packed row: `media[k]` of the k-th conversation (a vision_shape.Media, or None: text only),
    `text[k]` its text tokens, around its media tokens."""

    media: list
    text: list


def mixes(vision, name, rng):
    """The conversations of mix `name`: their media (sides in pixels) and text lengths."""
    from paddle_cp.cost.vision_shape import image, video

    if name == "images":  # 48 photos, sides 224-1344 px
        media = [image(vision, *rng.randint(224, 1345, 2)) for _ in range(48)]
    elif name == "video":  # one 4-minute clip at 2 frames a second, 448 x 448
        media = [video(vision, 480, 448, 448)]
    elif name == "videos":  # three clips of 30-120 s and 16 photos
        media = [video(vision, int(2 * s), 448, 448) for s in rng.randint(30, 121, 3)]
        media += [image(vision, *rng.randint(224, 1345, 2)) for _ in range(16)]
    elif name == "pages":  # 40 document pages, 896 x 1232 px
        media = [image(vision, 1232, 896) for _ in range(40)]
    else:
        raise ValueError(f"unknown mix {name!r}: use one of {list(MIXES)}")
    return Row(media, [int(n) for n in rng.randint(40, 400, len(media))])


def row_layout(vision, row):
    """(each position's document end and place in it, int64 [S] each; each piece's grid (h, w), its feature
    positions and its conversation) of a row: a conversation is its text's first half, its media's vision start,
    features and end, its text's second half."""
    ends, inside, grids, positions, conversation, start = [], [], [], [], [], 0
    for k, (item, text) in enumerate(zip(row.media, row.text)):
        length = text + item.tokens(vision) + 2
        ends.append(np.full(length, start + length))
        inside.append(np.arange(length))
        first = start + text // 2 + 1  # after its vision start token
        per_piece = item.h * item.w // vision.merge_unit
        for t in range(item.t):
            grids.append((item.h, item.w))
            positions.append(np.arange(first + t * per_piece, first + (t + 1) * per_piece))
            conversation.append(k)
        start += length
    return np.concatenate(ends), np.concatenate(inside), grids, positions, np.array(conversation)


def compare(model, row, sep):
    """{layout: figures} of one row over `sep` ring ranks (one node)."""
    from paddle_cp.cost.links import LinkCost, Links
    from paddle_cp.cost.packed_layout import choose
    from paddle_cp.cost.vision_layout import Pieces, feature_row_ms, joint_placement, rank_of_positions
    from paddle_cp.cost.vision_shape import Media
    from paddle_cp.cost.vision_split import piece_cost, stages

    vision = model.vision
    tower, decoder = stages(model, 2)  # bf16 features
    end, inside, grids, positions, conversation = row_layout(vision, row)
    costs = np.array([piece_cost(vision, tower, Media("image", 1, h, w)) for h, w in grids])
    sizes = np.array([len(p) for p in positions])
    pieces = Pieces(costs, np.concatenate([[0], np.cumsum(sizes)]), np.concatenate(positions), len(end))
    links = LinkCost.of_ranks(np.arange(sep), Links(ranks_per_node=sep))
    row_ms = feature_row_ms(links, 1, tower.row_bytes)

    def joint(groups, counts):
        return joint_placement(pieces, groups, counts, 1, decoder, row_ms)

    clock = time.process_time()
    chosen, _ = choose(end[None], inside[None] + 1, sep, 1, links, joint)
    host_ms = (time.process_time() - clock) * 1e3
    alone, _ = choose(end[None], inside[None] + 1, sep, 1, links)
    first = joint(alone.groups, alone.counts)
    owner = rank_of_positions(alone.groups)
    figures = {"paddle_cp": _figures(chosen.placement.rank, chosen.placement, rank_of_positions(chosen.groups),
                                     pieces, sizes, row_ms, host_ms),
               "language-first": _figures(first.rank, first, owner, pieces, sizes, row_ms, None),
               "whole": _figures(None, first, owner, pieces, sizes, row_ms, None)}
    frame_cost = np.array([h * w * (h * w + vision.hidden) for h, w in grids], np.float64)
    for name, rank in (("by-count", _contiguous(np.bincount(conversation), conversation, sep)),  # whole media
                       ("by-cost", _contiguous(frame_cost, np.arange(len(grids)), sep))):  # temporal patches
        figures[name] = _figures(rank, first, owner, pieces, sizes, row_ms, None, gathered=True)
    return figures


def _contiguous(weights, unit_of_piece, sep):
    """The rank of each piece when units (media, or pieces) are cut into `sep` contiguous groups of about equal
    `weights`, a unit whole on one rank."""
    weights = np.asarray(weights, np.float64)
    middle = np.cumsum(weights) - weights / 2
    return np.minimum((middle / weights.sum() * sep).astype(np.int64), sep - 1)[unit_of_piece]


def _figures(rank, placement, owner, pieces, sizes, row_ms, host_ms, gathered=False):
    """One layout's figures: pieces on `rank` (None: every piece on every rank, nothing sent) around the language
    work of `placement` (a VisionPlacement) over ranks holding positions as `owner` says; `gathered`: every feature
    all-gathered (each rank receives every feature another computed), else each sent to its token's rank."""
    sep, features = len(placement.language_ms), int(sizes.sum())
    destination = owner[pieces.positions % pieces.seq_len]
    if rank is None:
        vision = np.full(sep, pieces.cost.sum())
        received = needed = np.zeros(sep, np.int64)
        held = np.full(sep, features)
    else:
        vision = np.bincount(rank, weights=pieces.cost, minlength=sep)
        computed_by = np.repeat(rank, sizes)
        computed = np.bincount(computed_by, minlength=sep)
        needed = np.bincount(destination[computed_by != destination], minlength=sep)  # its tokens', computed elsewhere
        received = features - computed if gathered else needed
        held = computed + received
    if rank is None:
        exchange = np.zeros(sep)
    else:
        sent_to = np.zeros((sep, sep))  # [r, q]: rows r receives from q
        for r in range(sep):
            gets = (computed_by != r) if gathered else (destination == r) & (computed_by != r)
            sent_to[r] = np.bincount(computed_by[gets], minlength=sep)
        exchange = (sent_to * row_ms).sum(axis=1)
    total = vision + placement.language_ms
    slowest = vision.max() + exchange.max() + placement.language_ms.max()  # each stage waits for its slowest rank
    return {"vision_max_over_mean": float(vision.max() / vision.mean()),
            "total_max_over_mean": float(total.max() / total.mean()), "slowest_ms": float(slowest),
            "received_rows_max": int(received.max()), "least_rows_max": int(needed.max()),
            "held_max": int(held.max()), "features": features, "host_ms": host_ms}


def vl_model():
    """Qwen2.5-VL-7B's ModelShape (pcp-plan's named config)."""
    from paddle_cp.cost.model_shape import ModelShape
    from paddle_cp.tools.plan.models import read_model_config

    return ModelShape.from_config(read_model_config(MODEL))


def rows_of(args):
    model = vl_model()
    row_bytes = model.vision.out_hidden * 2
    out = []
    for mix in args.mixes:
        row = mixes(model.vision, mix, np.random.RandomState(args.seed))
        for layout, figures in compare(model, row, args.sep).items():
            out.append({"mix": mix, "sep": args.sep, "layout": layout, "row_bytes": row_bytes, **figures})
    return out


def table(rows):
    from paddle_cp.tools.text import ruled_table

    head = (f"{'mix':7} {'layout':14} {'vision max/mean':>15} {'vision+lang max/mean':>20} {'slowest ms':>10} "
            f"{'MiB max':>8} {'min MiB':>8} {'held/all':>8} {'host ms':>7}")
    return ruled_table(head, [
        f"{r['mix']:7} {r['layout']:14} {r['vision_max_over_mean']:>15.3f} {r['total_max_over_mean']:>20.3f} "
        f"{r['slowest_ms']:>10.1f} {r['received_rows_max'] * r['row_bytes'] / 2 ** 20:>8.1f} "
        f"{r['least_rows_max'] * r['row_bytes'] / 2 ** 20:>8.1f} {r['held_max'] / r['features']:>8.3f} "
        f"{'' if r['host_ms'] is None else format(r['host_ms'], '.0f'):>7}" for r in rows]) + (
        f"\n(model figures for {MODEL}, no GPU ran: forward + backward of the vision tower and the decoder, each "
        "rank's vision and language work priced by the tile model and the GEMM rate; MiB a rank receives of the "
        "features, forward (its gradients go back the same way); min: the least that layout's pieces make it "
        "receive; held/all: the most features a rank holds over all)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sep", type=int, default=8, help="context-parallel ranks (one node)")
    parser.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES), help="the batches' media")
    parser.add_argument("--seed", type=int, default=0, help="the mixes' random sizes and text lengths")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.sep < 2:
        parser.error("--sep must be at least 2")
    return args


def main(argv=None):
    from paddle_cp.tools.text import show

    args = parse_args(argv)
    rows = rows_of(args)
    show(table(rows), {"rows": rows}, args.json)
    return rows


if __name__ == "__main__":
    main()
