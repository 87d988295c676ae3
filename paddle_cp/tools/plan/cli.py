"""Plan a training run: pipeline x data x context (ring / Ulysses / hybrid) x tensor x expert parallel layouts,
with sharding levels, recomputation and chunked loss, for a model and a cluster.

    pcp-plan --config llama3-70b --seq 128K --devices 64 --memory-gb 80    # a name, a config.json or a model folder
    pcp-plan --config config.json --max-seq --devices 8 --memory-gb 80   # the longest that fits
    pcp-plan --config qwen2.5-vl-7b --video-seconds 60 --devices 8        # a vision-language model's video

Prints a table of candidates (best first: those that fit, fastest first), then for the best `--configs` layouts
the published recipe each resembles and the config to run it: YAML for `paddle_cp.load_config` (the PaddleFormers
config fields it assumes as comments on top); `--json` writes every estimate and those plans (config as a dict,
YAML, model fields). The cost model is paddle_cp/cost/ (search.py ranks the layouts): per-rank memory checked against pcp-memory on
CPU, GPU step times modelled, not measured. A vision-language model's media flags (plan/vision.py) rank the layouts
with its vision tower whole on every rank and split over the sep ranks, and print their memory term by term.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import yaml

from paddle_cp.attention.masks.block_mask import Documents
from paddle_cp.cost import search
from paddle_cp.tools import packing
from paddle_cp.cost.attention import PackedRow
from paddle_cp.cost.model_shape import ModelShape
from paddle_cp.tools.plan.models import NAMED, read_model_config
from paddle_cp.tools.plan.config import (gpu_attention_fields, kernel_fields, model_config, parallelize_config,
                                         rotary_note, trainer_arguments, vision_fields, VISION_TOWERS)
from paddle_cp.cost.candidate import DEFAULT_RESERVE, Cluster, Layout
from paddle_cp.cost.links import Links
from paddle_cp.tools.plan import vision
from paddle_cp.tools.plan.recipes import closest
from paddle_cp.tools.text import HelpFormatter, ruled_table
from paddle_cp.tools.units import UNITS_HELP, format_tokens, tokens

GB = 1e9
MB = 1e6
DEFAULT_RESERVE_GB = DEFAULT_RESERVE / GB
LEGEND = f"""\
lengths (--seq, --granularity, --loss-chunk, --mlp-tile): a count or a count with K or M ({UNITS_HELP}).

the table:
  layout        degrees, outermost first, then options:
                  dp<N> data-parallel replicas    ring<N> ring (p2p) context-parallel ranks
                  uly<N> Ulysses (all2all) ranks  tp<N> tensor-parallel ranks (with sequence parallel)
                  pp<N> pipeline stages           m<N> micro-batches per step   vpp<N> chunks per pipeline rank
                  ep<N> expert-parallel degree
                  l1/l2/l3 dp_config sharding_level over dp x sep (1: optimizer state, 2: + gradients,
                    3: + parameters; @dp or @sep: over that dim only); absent: level 0
                  full: whole layers recomputed; sel:<modules>: those modules recomputed
                  chunk<N>: lm_head and loss in chunks of N tokens   tile<N>: MLPs in tiles of N tokens
                  offload: recomputed layers' inputs in host memory (OffloadRecomputeInputs)
                  host-optimizer: optimizer state in host memory, stepped there (offload_optimizer)
  backend       p2p (ring), all2all (Ulysses), hybrid (both), none (no context parallelism)
  mem GB        the busiest rank's modelled peak, GB (10^9 bytes)
  host GB/node  offloaded layer inputs and optimizer state in each node's host memory
  fits          yes: mem GB within --memory-gb less --reserve-gb, and host GB/node within --host-memory-gb
  step s, tok/s the modelled GPU step time and tokens per second (all replicas)
  node MB, net MB  attention's bytes one rank receives per layer, forward + backward, within its node (NVLink) and
                from other nodes (the network), MB (10^6 bytes): Ulysses' all-to-alls and the ring's planned
                exchange (only the k/v rows other ranks' tiles read, and their gradients; the busiest ring rank)
  time split    compute, tensor_parallel, ulysses, ring_exposed (the ring's planned exchange at its links' rates,
                the part not hidden behind the layer's attention compute),
                pipeline_p2p, expert_all_to_all, gradients, host_offload_exposed, host_optimizer (s)
"""


# --kernels: the GPU kernels whose activations the memory model counts (cost/memory.py's FUSED_KERNELS)
KERNELS = {"eager": (), "fused-norm": ("rms_norm",), "fused": ("rms_norm", "rope")}
SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "vocab", "intermediate")


class _Dumper(yaml.SafeDumper):
    """Block style, except lists of scalars (mesh shape, dim names) on one line; the empty plan key (the model
    itself) as `'':`, not as a complex key."""

    def check_simple_key(self):
        return (isinstance(self.event, yaml.ScalarEvent) and self.event.value == "") or super().check_simple_key()


_Dumper.add_representer(list, lambda dumper, value: dumper.represent_sequence(
    "tag:yaml.org,2002:seq", value, flow_style=all(isinstance(v, (int, str)) for v in value)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="pcp-plan", description=__doc__.split("\n\n")[0], epilog=LEGEND,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--config", help="PaddleFormers / Hugging Face config.json, a model folder holding one, or a "
                                         f"model name ({', '.join(NAMED)}) (instead of the shape flags)")
    for flag in SHAPE_FLAGS:
        parser.add_argument("--" + flag.replace("_", "-"), type=int, help="the model's shape, without --config")
    parser.add_argument("--seq", type=tokens, help="sequence length in tokens (128K = 131072)")
    parser.add_argument("--max-seq", action="store_true",
                        help="find the longest sequence some layout fits (a multiple of --granularity) and plan it")
    parser.add_argument("--granularity", type=tokens, default=65536, help="--max-seq's step in tokens")
    parser.add_argument("--batch", type=int, default=1, help="sequences per data-parallel replica per step")
    parser.add_argument("--devices", type=int, required=True, help="GPUs in all")
    parser.add_argument("--memory-gb", type=float, default=80.0, help="memory per device, GB (10^9 bytes)")
    parser.add_argument("--reserve-gb", type=float, default=DEFAULT_RESERVE_GB,
                        help="memory per device no layout may plan for: the CUDA context and libraries' workspaces "
                             "(~1 GB), NCCL's buffers (~1 GB), the allocator's fragmentation (~3 GB)")
    parser.add_argument("--tflops", type=float, default=700.0,
                        help="achievable bf16 GEMM TFLOP/s per device (H200 at Llama-8B shapes: 695-772)")
    parser.add_argument("--attention-tflops", type=float, default=300.0,
                        help="causal attention forward + backward TFLOP/s (H200: FlashAttention-2 287-328, "
                             "cuDNN 544-577)")
    parser.add_argument("--pcie-gbps", type=float, default=25.0,
                        help="GB/s per device and direction to host memory (activation offload, host optimizer; "
                             "one H100 alone, both directions at once: 43.6; 8 share a host's memory)")
    parser.add_argument("--host-memory-gb", type=float, default=2000.0,
                        help="host memory per node for offloaded activations and optimizer state (DGX H100/H200: 2 TB)")
    parser.add_argument("--host-adamw-mparams", type=float, default=560.0,
                        help="millions of parameters per second one device's share of its host steps (the host "
                             "optimizer: Paddle's CPU AdamW kernel, one thread)")
    parser.add_argument("--kernels", choices=list(KERNELS), default="fused-norm",
                        help="activations with the GPU's fused RMSNorm and eager RoPE (fused-norm: PaddleFormers "
                             "1.2.0's Llama on a GPU as built), as its eager ops hold them on CPU (eager: what "
                             "pcp-memory measures) or with a fused RoPE too (fused: a kernel that Llama does not call)")
    parser.add_argument("--mlp-tile", type=tokens, default=search.DEFAULT_MLP_TILE,
                        help="tokens per SequenceTiled MLP tile the search tries (0: never tile)")
    parser.add_argument("--no-offload", action="store_true", help="never keep recomputed layers' inputs on the host")
    parser.add_argument("--no-host-optimizer", action="store_true",
                        help="never step the optimizer on the host (dp_config offload_optimizer)")
    parser.add_argument("--intra-gbps", type=float, default=Links().intra_gbps, help="GB/s per device within a node")
    parser.add_argument("--inter-gbps", type=float, default=Links().inter_gbps, help="GB/s per device across nodes")
    parser.add_argument("--devices-per-node", type=int, default=8, help="GPUs per node")
    parser.add_argument("--dtype-bytes", type=int, default=2,
                        help="parameter and activation bytes: 2 for bf16/fp16 O2 (PaddleFormers' default), 4 for fp32")
    parser.add_argument("--no-master-grad", action="store_true",
                        help="bf16/fp16 gradients (amp_master_grad: false) instead of fp32 master gradients")
    parser.add_argument("--no-causal", action="store_true", help="full (bidirectional) attention")
    parser.add_argument("--documents", metavar="LENGTHS",
                        help="the sequences pack documents of these lengths (pcp-bench's names or a file): attention "
                             "priced by the GPU tile model, and the ring's exchange by the rows its tiles read, in the "
                             "layout paddle_cp chooses for one row")
    parser.add_argument("--model-prefix", help="name of the decoder in the model, for plan keys (default: model; "
                                               "a vision-language model's: model.language_model)")
    parser.add_argument("--loss-chunk", type=tokens, default=search.DEFAULT_LOSS_CHUNK,
                        help="tokens per chunk of the chunked loss the search tries")
    parser.add_argument("--top", type=int, default=10, help="rows of the table")
    parser.add_argument("--configs", type=int, default=1, help="how many of the best fitting layouts to print as YAML")
    parser.add_argument("--json", help="write all estimates and the plans (configs) here")
    vision.add_arguments(parser)
    args = parser.parse_args(argv)
    media = args.video_frames or args.video_seconds or args.images or args.text_tokens
    if not args.config and any(getattr(args, f) is None for f in SHAPE_FLAGS if f != "kv_heads"):
        parser.error("give --config config.json, or --layers --hidden --heads --vocab --intermediate [--kv-heads]")
    if args.config:
        try:
            args.model_config = read_model_config(args.config)
        except ValueError as error:
            parser.error(str(error))
    if not media and (args.seq is None) == (not args.max_seq):
        parser.error("give --seq N, or --max-seq to find the longest sequence that fits")
    if args.granularity < 1 or args.mlp_tile < 0:
        parser.error("--granularity must be positive and --mlp-tile not negative")
    if min(args.pcie_gbps, args.host_adamw_mparams) <= 0:
        parser.error("--pcie-gbps and --host-adamw-mparams must be positive")
    if not 0 <= args.reserve_gb < args.memory_gb:
        parser.error("--reserve-gb must be at least 0 and below --memory-gb")
    return args


def packed_row(position_ids):
    """One row of packed documents (position ids [seq]) as the cost model prices it."""
    documents = Documents.from_position_ids(np.asarray(position_ids)[None])
    return PackedRow(documents.end, documents.keys_seen())


def model_shape(args):
    if args.config:
        return ModelShape.from_config(args.model_config)
    values = {f: getattr(args, f) for f in SHAPE_FLAGS}
    values["kv_heads"] = values["kv_heads"] or values["heads"]
    return ModelShape(**values)


def table(estimates, top):
    head = (f"{'layout':68} {'backend':8} {'mem GB':>8} {'host GB/node':>12} {'fits':>5} {'step s':>8} "
            f"{'tok/s':>10} {'node MB':>8} {'net MB':>8}  time split (s)")
    rows = []
    for e in estimates[:top]:
        split = " ".join(f"{k}={v:.3g}" for k, v in e["time"].items() if v)
        node, net = link_bytes(e["attention_bytes"])
        rows.append(f"{e['name']:68} {e['backend']:8} {e['memory_total'] / GB:>8.1f} {e['host_per_node'] / GB:>12.0f} "
                    f"{'yes' if e['fits'] else 'no':>5} {e['step_time']:>8.3f} {e['tokens_per_second']:>10.0f} "
                    f"{node / MB:>8.0f} {net / MB:>8.0f}  {split}")
    return ruled_table(head, rows)


def link_bytes(attention_bytes):
    """(within a node, across nodes): attention's bytes a rank receives per layer (step_time.attention_bytes)."""
    return (attention_bytes["ring_within_node"] + attention_bytes["ulysses_within_node"],
            attention_bytes["ring_across_nodes"] + attention_bytes["ulysses_across_nodes"])


def plan_of(estimate, model, seq, model_prefix, fused=(), vision_tower=None):
    """What runs one estimated layout: the parallelize config (dict and YAML), the PaddleFormers config fields
    and TrainingArguments (paddle_cp's Trainer), and the published recipe it resembles. `fused`: the GPU kernels
    the estimate counts (KERNELS' values); `vision_tower`: a vision-language model's tower split by images."""
    layout = Layout(**estimate["layout"])
    config = parallelize_config(layout, model_prefix, vision_tower)
    fields = {**model_config(layout), **gpu_attention_fields(layout), **kernel_fields(fused),
              **(vision_fields(layout) if model.vision else {})}
    arguments = trainer_arguments(layout)
    sections = {"PaddleFormers config": fields, "PaddleFormers TrainingArguments": arguments}
    header = "".join(f"# {line}\n" for line in yaml.dump(
        {k: v for k, v in sections.items() if v}, Dumper=_Dumper, sort_keys=False).splitlines()) if fields or arguments else ""
    note = rotary_note(fused)
    header = (f"# NOTE: {note}\n" if note else "") + header
    return {"name": estimate["name"], "config": config, "model_config": fields, "training_arguments": arguments,
            "yaml": header + yaml.dump(config, Dumper=_Dumper, sort_keys=False),
            "resembles": closest(model.params, layout, seq)}


def describe(plan, estimate):
    like = plan["resembles"]
    differs = "; ".join(like["differs"]) or "the same degrees"
    return (f"# {plan['name']} ({estimate['backend']}): {estimate['tokens_per_second']:.0f} tokens/s, "
            f"{estimate['memory_total'] / GB:.1f} GB per device\n"
            f"# resembles {like['recipe']} ({like['degrees']}; {like['sharding']}; recompute {like['recompute']}): "
            f"{differs}\n{plan['yaml']}")


def model_prefix(args, model):
    """Where the decoder layers sit, for plan keys: --model-prefix, else PaddleFormers' (`model`; a vision-language
    model's language model `model.language_model`)."""
    return args.model_prefix or ("model.language_model" if model.vision else "model")


def print_plans(args, model, seq, fitting, vision_tower=None):
    """The best fitting layouts' configs (printed, returned); `vision_tower`: plan_of's."""
    plans = [plan_of(e, model, seq, model_prefix(args, model), KERNELS[args.kernels], vision_tower)
             for e in fitting[:args.configs]]
    for plan, estimate in zip(plans, fitting):
        print("\n" + describe(plan, estimate), end="")
    return plans


def no_fit_line(args):
    return (f"no layout fits in {args.memory_gb - args.reserve_gb:g} GB per device (--memory-gb less "
            "--reserve-gb): add devices, shorten the sequence or lower the batch")


def plan_vision_language(args, model, cluster, options):
    """The vision-language run (plan/vision.py): each mode's ranking, their terms side by side, the configs of the
    best fitting layouts with the tower whole (what runs today)."""
    refusal = vision.refusal(args, model)
    if refusal:
        sys.exit(f"pcp-plan: {refusal}")
    modes = vision.ranked_modes(args, model, cluster, options)
    for mode, found in modes.items():
        longest = "the longest video that fits, " if args.max_seq else ""
        print(f"\nvision tower {mode}: {longest}"
              + (vision.media_lines(model.vision, found["media"], args.text_tokens, args.fps) if found["media"]
                 else "none (not one temporal patch)"))
        if found["estimates"]:
            print(table(found["estimates"], args.top))
        if not any(e["fits"] for e in found["estimates"]):
            print(no_fit_line(args))
    print("\nmemory per term (GB per rank), the best layouts of each mode:")
    print(vision.per_term_table(vision.compared(model, cluster, options, modes, same_media=not args.max_seq)))
    plans = {}
    for mode, found in modes.items():
        if args.configs:
            print(f"\n# vision tower {mode}:", end="")
        tower = VISION_TOWERS[model.family] if mode == "split" else None
        plans[mode] = print_plans(args, model, found["seq"], [e for e in found["estimates"] if e["fits"]], tower)
    if args.json:
        result = {"model": asdict(model), "cluster": vars(cluster), "max_seq": args.max_seq,
                  "vision": {mode: {**found, "media": [asdict(item) for item in found["media"]], "plans": plans[mode]}
                             for mode, found in modes.items()}}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None):
    args = parse_args(argv)
    try:
        model = model_shape(args)
    except ValueError as error:  # a shape the planner cannot model: say so, no traceback
        sys.exit(f"pcp-plan: {error}")
    cluster = Cluster(args.devices, args.memory_gb * GB, args.tflops * 1e12, args.intra_gbps * GB,
                      args.inter_gbps * GB, args.devices_per_node, args.attention_tflops * 1e12,
                      args.pcie_gbps * GB, args.host_memory_gb * GB, args.host_adamw_mparams * 1e6,
                      args.reserve_gb * GB)
    options = dict(batch=args.batch, elem=args.dtype_bytes, causal=not args.no_causal, loss_chunk=args.loss_chunk,
                   mlp_tile=args.mlp_tile, fused=KERNELS[args.kernels], offload=not args.no_offload,
                   offload_optimizer=not args.no_host_optimizer, master_grad=not args.no_master_grad)
    if vision.applies(args, model):
        return plan_vision_language(args, model, cluster, options)
    if args.documents:
        if args.max_seq:
            sys.exit("pcp-plan: --documents prices one row of --seq tokens: give --seq instead of --max-seq")
        try:
            options["packed"] = packed_row(packing.batches(args.documents, args.seq, 1, 1)[0][0])
        except ValueError as error:
            sys.exit(f"pcp-plan: --documents: {error}")
    if args.max_seq:
        args.seq, estimates = search.longest_sequence(model, cluster, args.granularity, **options)
        if not args.seq:
            sys.exit(f"pcp-plan: no layout of {args.devices} devices fits {args.granularity} tokens of {model}")
        print(f"longest sequence that fits: {args.seq} tokens ({format_tokens(args.seq)}; multiples of "
              f"{format_tokens(args.granularity)}; {UNITS_HELP}), {args.kernels} kernels, "
              f"{args.memory_gb - args.reserve_gb:g} of {args.memory_gb:g} GB per device\n")
    else:
        estimates = search.rank_layouts(model, cluster, args.seq, **options)
    if not estimates:
        sys.exit(f"no layout of {args.devices} devices suits {model} at sequence {args.seq}")
    print(table(estimates, args.top))
    fitting = [e for e in estimates if e["fits"]]
    if not fitting:
        print("\n" + no_fit_line(args))
    plans = print_plans(args, model, args.seq, fitting)
    fitting = fitting[:args.configs]
    if args.json:
        result = {"model": asdict(model), "cluster": vars(cluster), "seq": args.seq, "max_seq": args.max_seq,
                  "estimates": estimates,
                  "best": fitting[0] if fitting else None, "plans": plans,
                  "config": plans[0]["config"] if plans else None}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
