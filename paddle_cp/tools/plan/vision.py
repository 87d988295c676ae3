"""pcp-plan for a vision-language model: a sequence's media from the flags, the layouts ranked with the vision tower
whole on every rank (PrepareContextParallel alone) and split over the sep ranks by images (ContextParallel on the
tower too: plans/vision_split.py), the memory per term and the step time of the best layouts in both, and the
configs that run them.

    pcp-plan --config qwen2.5-vl-7b --video-seconds 60 --fps 2 --frame-size 448x448 --devices 8
    pcp-plan --config qwen2.5-vl-7b --images 4 --image-size 1344x1344 --text-tokens 2K --devices 8
    pcp-plan --config qwen2.5-vl-7b --max-seq --frame-size 448x448 --devices 8     # the longest video that fits

The sequence: each image, then the video, each its vision start token, its features and its vision end token, then
--text-tokens of text; its length is theirs (no --seq). The cost terms are paddle_cp/cost/vision_language.py's.
"""
from __future__ import annotations

import argparse
import re

from paddle_cp.cost import search
from paddle_cp.cost.candidate import Layout
from paddle_cp.cost.vision_language import MODES, VisionBatch
from paddle_cp.cost.vision_shape import image, media_tokens, video
from paddle_cp.tools.text import ruled_table
from paddle_cp.tools.units import format_tokens, tokens

GB = 1e9
MB = 1e6
COMPARED = 3  # layouts of each mode's ranking shown in both modes, term by term
# the per-term columns: (the estimate's memory key, heading)
TERMS = (("weights", "weights"), ("gradients", "grads"), ("optimizer", "optim"), ("activations", "LM act"),
         ("logits", "logits"), ("vision_activations", "vision act"), ("features", "features"), ("merge", "merge"),
         ("inputs_embeds", "embeds"), ("pixel_values", "pixels"))


def pixels(text):
    """An argparse type: 'HxW' pixels (height x width) -> (height, width)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if not match or min(int(match.group(1)), int(match.group(2))) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in pixels: give HEIGHTxWIDTH, e.g. 448x448")
    return int(match.group(1)), int(match.group(2))


def add_arguments(parser):
    group = parser.add_argument_group("vision-language models (a --config with a vision_config)")
    group.add_argument("--video-frames", type=int, help="one video of this many frames per sequence")
    group.add_argument("--video-seconds", type=float, help="one video this long per sequence, sampled at --fps")
    group.add_argument("--fps", type=float, default=2.0, help="frames per second sampled from --video-seconds")
    group.add_argument("--frame-size", type=pixels, default=(448, 448), help="the video's frames, HEIGHTxWIDTH pixels")
    group.add_argument("--images", type=int, default=0, help="images per sequence (before the video)")
    group.add_argument("--image-size", type=pixels, default=(448, 448), help="each image, HEIGHTxWIDTH pixels")
    group.add_argument("--text-tokens", type=tokens, default=0, help="text tokens per sequence after the media")
    group.add_argument("--vision", choices=[*MODES, "both"], default="both",
                       help="the vision tower whole on every rank, split over the sep ranks by images (ContextParallel "
                            "on the tower), or both")


def applies(args, model):
    """Whether this run plans a vision-language batch: media flags, or --max-seq (the longest video) on a model
    with a vision tower."""
    return bool(args.video_frames or args.video_seconds or args.images or args.text_tokens
                or (model.vision and args.max_seq))


def refusal(args, model):
    """Why the flags cannot plan a vision-language batch (None when they can)."""
    if not model.vision:
        return (f"--video-frames, --video-seconds, --images and --text-tokens describe a vision-language batch; "
                f"{model.family} has no vision tower (a config.json with a vision_config)")
    if args.seq is not None:
        return "a vision-language sequence is its media's tokens plus --text-tokens: drop --seq"
    if args.documents:
        return "--documents prices packed text rows; a vision-language sequence is its media and text"
    if args.video_frames and args.video_seconds:
        return "give the video as --video-frames or as --video-seconds (with --fps), not both"
    if args.max_seq and (args.video_frames or args.video_seconds):
        return "--max-seq finds the longest video at --frame-size: drop --video-frames / --video-seconds"
    if args.fps <= 0 or args.images < 0 or (args.video_frames or 1) < 1 or (args.video_seconds or 1) <= 0:
        return "--fps, --video-frames and --video-seconds must be positive, --images not negative"
    if not args.max_seq and not (args.video_frames or args.video_seconds or args.images):
        return "give the media: --video-frames N, --video-seconds S, or --images K"
    return None


def media(args, vision, temporal_patches=None):
    """A sequence's media from the flags: the images, then the video (`temporal_patches` of it, when given)."""
    found = [image(vision, *args.image_size) for _ in range(args.images)]
    frames = (temporal_patches * vision.temporal_patch if temporal_patches is not None
              else round(args.video_seconds * args.fps) if args.video_seconds else args.video_frames or 0)
    if frames:
        found.append(video(vision, max(1, frames), *args.frame_size))
    return found


def media_lines(vision, items, text_tokens, fps):
    """The media and the sequence they make, in words."""
    lines = []
    for item in items:
        frames = item.t * vision.temporal_patch
        what = f"a video of {frames} frames ({frames / fps:g} s at {fps:g} fps)" if item.kind == "video" else "an image"
        lines.append(f"{what}, {item.h * vision.patch}x{item.w * vision.patch} pixels as resized: grid {item.t} x "
                     f"{item.h} x {item.w} = {item.patches} patches, {item.tokens(vision)} tokens")
    seq = media_tokens(vision, items) + text_tokens
    lines.append(f"sequence: {seq} tokens ({format_tokens(seq)}): the media's, a vision start and end each, "
                 f"{text_tokens} of text")
    return "\n".join(lines)


def ranked_modes(args, model, cluster, options):
    """{mode: {"media", "seq", "estimates"}} for the modes --vision asks for; under --max-seq each mode's longest
    video."""
    found = {}
    for mode in MODES if args.vision == "both" else (args.vision,):
        if args.max_seq:
            units, estimates = search.longest_video(model, cluster, lambda n: media(args, model.vision, n),
                                                    args.text_tokens, mode=mode, **options)
            items = media(args, model.vision, units)
        else:
            items = media(args, model.vision)
            estimates = search.rank_layouts(model, cluster, media_tokens(model.vision, items) + args.text_tokens,
                                            vision=VisionBatch(items, mode), **options)
        found[mode] = {"media": items, "seq": media_tokens(model.vision, items) + args.text_tokens,
                       "estimates": estimates}
    return found


def compared(model, cluster, options, modes, same_media=True):
    """[(mode, estimate)]: the best COMPARED layouts of each mode's ranking and its best with the sequence over the
    most sep ranks, each estimated in every mode on the same media; `same_media` False (--max-seq: each mode's own
    longest video): each mode's own rows."""
    if not same_media:
        return [(mode, e) for mode, found in modes.items() for e in found["estimates"][:COMPARED]]
    names = []
    for found in modes.values():
        widest = max((e["layout"]["ring"] * e["layout"]["ulysses"] for e in found["estimates"]), default=1)
        split = [e for e in found["estimates"] if e["layout"]["ring"] * e["layout"]["ulysses"] == widest][:1]
        names += [e["name"] for e in found["estimates"][:COMPARED] + split if e["name"] not in names]
    return [(mode, search.estimate(model, Layout.parse(name), cluster, found["seq"], options["batch"], options["elem"],
                                   options["causal"], options["fused"], master_grad=options["master_grad"],
                                   vision=VisionBatch(found["media"], mode)))
            for name in names for mode, found in modes.items()]


def per_term_table(rows):
    """rows: (mode, estimate) pairs: each one's memory per term (GB per rank), peak, step time and its vision part,
    and the features a rank moves (MB, forward + backward)."""
    head = (f"{'layout':44} {'vision':6}" + "".join(f" {title:>10}" for _, title in TERMS)
            + f" {'peak':>7} {'fits':>4} {'step s':>7} {'vision s':>8} {'exch MB':>8}")
    lines = []
    for mode, e in rows:
        mem = e["memory"]
        lines.append(f"{e['name']:44} {mode:6}" + "".join(f" {mem[key] / GB:>10.2f}" for key, _ in TERMS)
                     + f" {mem['peak'] / GB:>7.1f} {'yes' if e['fits'] else 'no':>4} {e['step_time']:>7.3f}"
                     f" {e['time']['vision_compute']:>8.3f} {mem['exchange_bytes'] / MB:>8.1f}")
    return ruled_table(head, lines)
