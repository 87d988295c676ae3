"""`pcp-memory --vision-language`: a PaddleFormers Qwen2.5-VL training step on a video, its memory per rank on CPU
ranks with the vision tower whole and split, beside the planner's estimate for the same shape.

    pcp-memory --vision-language --nproc 2 --frames 16 --frame-size 64x64 --json vl.json

One launch of --nproc CPU ranks; per --vision mode it builds a small Qwen2.5-VL (the size flags; fp32, its eager
attention in the tower as the CPU runs it, unfused RMSNorm), parallelizes it with the config pcp-plan writes
(plan/config.py: PrepareContextParallel on the top model, ContextParallel on the language model's attention and,
`split`, on the tower), and trains AdamW steps on one sequence: a vision start token, the video's features'
placeholders, a vision end token, then --text-tokens of text (the labels), the video's pixel rows drawn at random
in the processor's layout ([patches, 3 x temporal patch x patch^2]). Per rank, the largest over ranks, from Paddle's
host allocator statistics, what pcp-memory reports (params, optimizer, activations: what the forward keeps to the
end of the model that merges, the tower's, the merge's and the decoder's; peak) and `vision`: what the tower holds
at the end of its forward, its output features left out. (The logits are left out: at these sizes the head's
[tokens, vocab] logits are about the whole embeddings freed as the model that merges returns.) The launching
process puts the planner's estimate (cost/memory.py with a vision_language.VisionBatch of the same media: fp32,
eager attention) beside each and their ratio.

CPU stand-in: Qwen2.5-VL's get_window_index makes Paddle 3.3.1's CPU pad kernel read a padding of -1 from its 0-D
grid tensors; it is given the grid as host integers (the same values).
"""
from __future__ import annotations

import argparse

from paddle_cp.cost.candidate import Layout
from paddle_cp.cost.memory import memory
from paddle_cp.cost.model_shape import ModelShape
from paddle_cp.cost.vision_language import MODES, VisionBatch
from paddle_cp.cost.vision_shape import VisionShape, media_tokens, video
from paddle_cp.tools.plan.vision import pixels
from paddle_cp.tools.launcher import tool_main
from paddle_cp.tools.text import ruled_table

PARTS = ("params", "optimizer", "vision", "activations", "peak")
MIB = 2 ** 20
FP32 = 4
MERGE, TEMPORAL = 2, 2
VISION_START, VISION_END, VIDEO = 122, 123, 121  # placeholder ids past the text's (1 to 100)
TOWER = "model.visual"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="pcp-memory --vision-language", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vision-language", action="store_true", required=True)
    parser.add_argument("--nproc", type=int, default=2, help="context-parallel ranks")
    parser.add_argument("--backend", choices=["p2p", "all2all"], default="p2p")
    parser.add_argument("--vision", nargs="+", choices=MODES, default=list(MODES), help="the tower's modes")
    parser.add_argument("--frames", type=int, default=16, help="the video's frames (a multiple of 2)")
    parser.add_argument("--frame-size", type=pixels, default=(64, 64),
                        help="HEIGHTxWIDTH pixels, multiples of patch x 2")
    parser.add_argument("--text-tokens", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--vision-depth", type=int, default=2)
    parser.add_argument("--vision-hidden", type=int, default=32)
    parser.add_argument("--vision-intermediate", type=int, default=64)
    parser.add_argument("--vision-heads", type=int, default=2)
    parser.add_argument("--patch", type=int, default=4, help="pixels a side of a patch")
    parser.add_argument("--window", type=int, default=16, help="pixels a side of a windowed block's window")
    parser.add_argument("--full-blocks", type=int, nargs="*", default=[1], help="blocks attending whole frames")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    side = args.patch * MERGE
    if args.frames < TEMPORAL or args.frames % TEMPORAL or any(p % side for p in args.frame_size):
        parser.error(f"--frames must be a positive multiple of {TEMPORAL}, --frame-size multiples of {side} pixels")
    if args.vocab <= VISION_END:
        parser.error(f"--vocab must exceed the placeholder ids ({VISION_END})")
    return args


def vision_shape(args):
    return VisionShape(depth=args.vision_depth, hidden=args.vision_hidden, intermediate=args.vision_intermediate,
                       heads=args.vision_heads, patch=args.patch, temporal_patch=TEMPORAL, merge=MERGE,
                       out_hidden=args.hidden, window=args.window, full_blocks=tuple(args.full_blocks))


def model_shape(args):
    return ModelShape(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                      vocab=args.vocab, intermediate=args.intermediate, family="qwen2_5_vl", vision=vision_shape(args))


def layout(args):
    return Layout(ring=args.nproc) if args.backend == "p2p" else Layout(ulysses=args.nproc)


def clip(args):
    """The video as the tower takes it."""
    return video(vision_shape(args), args.frames, *args.frame_size)


# ---- the rank side ----------------------------------------------------------------

def build(args):
    """PaddleFormers' Qwen2.5-VL of the flags' sizes, unfused RMSNorm (CPU), its window index from host integers."""
    import numpy as np

    from paddle_cp.integrations import zoo

    pf = zoo.transformers()
    vision = vision_shape(args)
    config = pf.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, fuse_rms_norm=False,
                         rope_scaling={"type": "mrope", "mrope_section": _mrope_section(args)}),
        vision_config=dict(depth=vision.depth, hidden_size=vision.hidden, intermediate_size=vision.intermediate,
                           num_heads=vision.heads, patch_size=vision.patch, temporal_patch_size=TEMPORAL,
                           spatial_merge_size=MERGE, out_hidden_size=args.hidden, window_size=vision.window,
                           fullatt_block_indexes=list(vision.full_blocks)),
        image_token_id=120, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    config.vision_config.fuse_rms_norm = False
    model = pf.Qwen2_5_VLForConditionalGeneration(config)
    tower = model.model.visual
    window_index = tower.get_window_index
    tower.get_window_index = lambda grid: window_index(np.asarray(grid.numpy(), dtype=np.int64))
    return model


def _mrope_section(args):
    """The text head's rotary halves given to t, h, w: a quarter, and the rest split between h and w."""
    half = args.hidden // args.heads // 2
    return [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]


def batch(args):
    """One sequence: the video's placeholders between its start and end tokens, then text; labels on the text."""
    import numpy as np
    import paddle

    item = clip(args)
    rng = np.random.RandomState(0)
    ids = np.concatenate([[VISION_START], [VIDEO] * item.tokens(vision_shape(args)), [VISION_END],
                          rng.randint(1, 100, args.text_tokens)]).astype(np.int64)
    labels = np.where(ids < 100, np.roll(ids, -1), -100)
    labels[-1] = -100
    patch_pixels = 3 * TEMPORAL * args.patch * args.patch
    return {"input_ids": paddle.to_tensor(ids[None]), "labels": paddle.to_tensor(labels[None]),
            "pixel_values_videos": paddle.to_tensor(rng.randn(item.patches, patch_pixels).astype(np.float32)),
            "video_grid_thw": paddle.to_tensor([[item.t, item.h, item.w]], dtype="int64")}


def _tower_held(tower):
    """[bytes]: what the tower holds at the end of each forward, its output features left out."""
    from paddle_cp.tools.allocator import allocated

    held, start = [], []
    tower.register_forward_pre_hook(lambda *_: start.append(allocated()))

    def after(layer, inputs, output):
        features = output[0] if isinstance(output, (tuple, list)) else output
        held.append(allocated() - start[-1] - features.numel().item() * features.element_size())

    tower.register_forward_post_hook(after)
    return held


def measure(args, mode):
    """This rank's {part: bytes} for one step with the tower `mode`."""
    import gc

    import paddle
    import paddle.distributed as dist

    import paddle_cp as pcp
    from paddle_cp.tools.allocator import allocated
    from paddle_cp.tools.memory.step import step_parts
    from paddle_cp.tools.plan.config import parallelize_config

    gc.collect()
    start = allocated()
    paddle.seed(0)
    model = build(args)
    opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())
    config = parallelize_config(layout(args), "model.language_model", TOWER if mode == "split" else None)
    mesh, config = pcp.load_config(config, world_size=dist.get_world_size())
    model, opt = pcp.parallelize(model, opt, mesh, config)
    params = allocated() - start
    held = _tower_held(model.model.visual)
    parts = step_parts(model, opt, batch(args), start, params)
    return {**parts, "vision": held[-1]}


def run_ranks(args):
    import paddle.distributed as dist

    from paddle_cp.tools.launcher import progress
    from paddle_cp.tools.ranks import max_over_ranks, start_cpu_ranks

    start_cpu_ranks(args.nproc)
    rows = []
    for mode in args.vision:
        progress(f"vision tower {mode}: {args.frames} frames at {args.frame_size[0]}x{args.frame_size[1]}")
        parts = measure(args, mode)
        rows.append({"mode": mode, **dict(zip(PARTS, (int(v) for v in max_over_ranks([parts[p] for p in PARTS]))))})
    return rows if dist.get_rank() == 0 else None


# ---- the launcher side ------------------------------------------------------------

def estimate(args, mode):
    """The planner's fp32 estimate of PARTS for the launch's shape and media, the tower `mode`."""
    model, item = model_shape(args), clip(args)
    seq = media_tokens(model.vision, [item]) + args.text_tokens
    found = memory(model, layout(args), seq, 1, FP32, vision=VisionBatch((item,), mode, kernel="eager"))
    return {"params": found["weights"], "optimizer": found["optimizer"], "vision": found["vision_activations"],
            "activations": found["activations"] + found["vision_activations"] + found["merge"], "peak": found["peak"]}


def summarise(args, rows):
    """The ranks' measured rows beside the estimate."""
    for row in rows:
        row["estimate"] = estimate(args, row["mode"])
        row["ratio"] = {p: row["estimate"][p] / row[p] for p in PARTS if row[p]}
    item = clip(args)
    return {"config": {key: getattr(args, key) for key in vars(args) if key not in ("result_file", "json")},
            "media": {"t": item.t, "h": item.h, "w": item.w, "patches": item.patches}, "rows": rows}


def table(result):
    head = f"{'tower':7}" + "".join(f" {p + ' MiB (est)':>21}" for p in PARTS)
    lines = [f"{row['mode']:7}" + "".join(f" {row[p] / MIB:>9.2f} ({row['estimate'][p] / MIB:>8.2f})"
                                             for p in PARTS) for row in result["rows"]]
    return ruled_table(head, lines)


def main(argv=None):
    tool_main(argv, parse_args, run_ranks, summarise, table, __file__)


if __name__ == "__main__":
    main()
