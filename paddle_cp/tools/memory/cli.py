"""Memory of a PaddleFormers Llama training step under context parallelism, per rank.

    pcp-memory --nproc 1 2 4 --seq 1024 --budget-mib 64 --json out.json
    (from a checkout: python tools/bench_memory.py ...)
    pcp-memory --phases ...: startup and I/O phases instead (memory/phases.py)
    pcp-memory --experts ...: a MoE model with and without expert parallelism (memory/experts.py)
    pcp-memory --layouts "dp2 ring2 l3@dp" ...: pcp-plan's layouts beside its estimate (memory/layouts.py)
    pcp-memory --sharding ...: what each sharding level leaves a rank instead (memory/sharding.py)
    pcp-memory --vision-language ...: a Qwen2.5-VL step on a video, its tower whole and split (memory/vision_language.py)

For each N (one launch of N CPU ranks; N = 1 is one process with the same plans,
so the same blockwise attention kernel) and each variant (recompute: PaddleFormers'
full-layer recompute flags; chunked: its use_fused_head_and_loss_fn with
loss_subbatch_sequence_length=--chunk, lm_head and loss in chunks of tokens) it
runs forward + backward + AdamW step at the global lengths --seq and reports per
rank, from Paddle's host allocator statistics (`Allocated`: tensors only, not
the Python heap or gloo buffers), the largest over ranks:

- params: bytes the model's parameters and buffers hold;
- optimizer: bytes AdamW's state holds after its first step;
- activations: bytes the decoder stack holds at the end of its forward (what
  backward needs from it);
- logits: bytes lm_head and the loss add on top by the end of the forward;
- peak: the most allocated at any moment of the step, parameters included.

With --budget-mib it also finds, by bisection on measured peaks, the longest
global length (a multiple of --granularity) whose step fits the budget on every
rank. `--single` adds one process running the model as PaddleFormers does
(Paddle's SDPA, no paddle_cp): the user's baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from paddle_cp.tools.memory import layouts as memory_layouts
from paddle_cp.tools.launcher import launch
from paddle_cp.tools.memory.breakdown import MIB, PARTS, VARIANTS, run_ranks
from paddle_cp.tools.text import HelpFormatter, ruled_table, show
from paddle_cp.tools.units import tokens


MODES = """\
other measurements, each with its own flags (pcp-memory MODE --help):
  --phases      startup and I/O phases (eager vs lazy initialization), per rank
  --experts     a MoE step with expert parallelism beside sharding level 3, its all-to-alls against their minimum
  --sharding    what each sharding level leaves a rank on sep4 and dp2 x sep2
  --vision-language  a Qwen2.5-VL step on a video per rank, its vision tower whole and split, beside the estimate
docs/long_context.md and docs/tools.md explain the figures."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="pcp-memory", description=__doc__.split("\n\n")[0], epilog=MODES,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4], help="context-parallel ranks")
    parser.add_argument("--seq", type=tokens, nargs="+", default=[1024],
                        help="global lengths to break down (1K = 1024)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--budget-mib", type=float, help="per-rank budget: find the longest length that fits")
    parser.add_argument("--fit-variants", nargs="+", choices=list(VARIANTS), default=["plain", "recompute+chunked"])
    parser.add_argument("--granularity", type=tokens, default=64, help="bisection step in tokens")
    parser.add_argument("--single", action="store_true", help="also one process without paddle_cp")
    parser.add_argument("--backend", choices=["p2p", "all2all"], default="p2p")
    parser.add_argument("--chunk", type=tokens, default=256, help="tokens per lm_head+loss chunk (chunked)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=344)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--layouts", nargs="+", help="planned layouts instead of --nproc and --variants, "
                        "each beside the planner's estimate (memory/layouts.py), e.g. 'dp2 ring2 l3@dp'")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--result-file", help=argparse.SUPPRESS)  # launcher <-> rank 0
    parser.add_argument("--no-cp", action="store_true", help=argparse.SUPPRESS)  # the --single run
    args = parser.parse_args(argv)
    for n in args.nproc:
        if n < 1 or any(seq < 2 * n for seq in args.seq):
            parser.error(f"--nproc {n}: every --seq must be at least 2 x N")
    if args.granularity < 1 or args.chunk < 1:
        parser.error("--granularity and --chunk must be positive")
    return args



# ---- the launcher side ------------------------------------------------------------

def collect(args, argv):
    """Launch every N (and the plain single process) and merge their results."""
    cases, fits = [], {}
    runs = [(n, []) for n in args.nproc] + ([(1, ["--no-cp"])] if args.single else [])
    for n, extra in runs:
        launch_args = argparse.Namespace(nproc=n)
        result = launch(launch_args, [*argv, *extra], script=__file__)
        cases += result["cases"]
        fits["single" if extra else str(n)] = result["fits"]
    result = {"config": _config(args), "cases": cases, "fits": fits}
    result["activation_ratio"] = activation_ratios(result)
    return result


def _config(args):
    return {key: getattr(args, key) for key in ("backend", "chunk", "hidden", "layers", "heads", "kv_heads",
                                                "intermediate", "vocab", "budget_mib", "granularity")}


def table(result):
    head = f"{'N':>6} {'variant':18} {'seq':>6}" + "".join(f" {p + ' MiB':>15}" for p in PARTS)
    rows = [f"{c['nproc']!s:>6} {c['variant']:18} {c['seq']:>6}" + "".join(f" {c[p] / MIB:>15.2f}" for p in PARTS)
            for c in result["cases"]]
    for key, ratios in result["activation_ratio"].items():
        rows.append(f"activations vs N=1, {key}: " + ", ".join(f"N={n} {r:.3f}" for n, r in ratios.items()))
    for n, fits in result["fits"].items():
        for variant, fit in fits.items():
            rows.append(f"longest fit, N={n} {variant}: {fit['tokens']} tokens")
    return ruled_table(head, rows)


def activation_ratios(result):
    """{"variant@seq": {N: activation bytes per rank at N / at N = 1}} for the paddle_cp runs."""
    base = {(c["variant"], c["seq"]): c["activations"] for c in result["cases"] if c["nproc"] == 1}
    ratios = {}
    for c in result["cases"]:
        key = (c["variant"], c["seq"])
        if c["nproc"] != "single" and key in base:
            ratios.setdefault(f"{key[0]}@{key[1]}", {})[str(c["nproc"])] = c["activations"] / base[key]
    return ratios


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--phases" in argv:  # the startup and I/O phases: their own tool
        from paddle_cp.tools.memory.phases import main as phases_main

        return phases_main(argv)
    if "--experts" in argv:  # a MoE model with and without expert parallelism: its own tool
        from paddle_cp.tools.memory.experts import main as experts_main

        return experts_main(argv)
    if "--sharding" in argv:  # sharding levels on a context-parallel mesh: their own tool
        from paddle_cp.tools.memory.sharding import main as sharding_main

        return sharding_main(argv)
    if "--vision-language" in argv:  # a vision-language model on a video: its own tool
        from paddle_cp.tools.memory.vision_language import main as vision_language_main

        return vision_language_main(argv)
    args = parse_args(argv)
    if "PADDLE_TRAINER_ID" not in os.environ and not args.no_cp:
        tool = memory_layouts if args.layouts else sys.modules[__name__]
        result = tool.collect(args, argv)
        show(tool.table(result), result, args.json)
        return
    result = (memory_layouts.run_ranks if args.layouts else run_ranks)(args)
    if result is not None:
        Path(args.result_file).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
