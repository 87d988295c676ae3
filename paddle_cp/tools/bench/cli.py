"""Benchmark context-parallel attention against one process doing the whole sequence.

    pcp-bench --nproc 2 --seq 2048 --backend p2p --causal --json out.json
    pcp-bench --mixer gated_deltanet --nproc 2 4 --seq 2048    (a Gated DeltaNet layer: bench/gdn.py)
    pcp-bench --saves --nproc 2 --steps 30 --save-every 10     (a step's cost of async saves: bench/saves.py)
    pcp-bench --planning --nproc 8 --seq 131072 --documents lognormal   (host planning: bench/planning.py)
    pcp-bench --pool --dp 2 --sep 4 --seq 64K --documents lognormal   (dp x sep pool against fixed: bench/pool.py)
    pcp-bench --vision --sep 8   (vision-language batches, the vision tower split by images: bench/vision.py)

Launches N CPU ranks itself (`python -m paddle.distributed.launch`, one thread per
rank), or runs as one of them when started inside a launch (PADDLE_TRAINER_ID set).
For every sequence length and backend it runs forward+backward of attention on
[b, s, h, d] fp32 tensors and reports, per case:

- efficiency = T_single / (N x T_rank). T_single: Paddle's
  F.scaled_dot_product_attention on the whole sequence, timed on one thread
  while no rank runs (before the launch, or on rank 0 after the others are
  done), so it has a core to itself and no rank waits on it. T_rank: the slowest rank's median time of
  paddle_cp.ring_attention / ulysses_attention / hybrid_attention on its shard (communication
  included). `efficiency_same_kernel` uses paddle_cp's own blockwise kernel for
  T_single instead, isolating the cost of splitting from the kernel's speed.
- kernel_util = useful FLOP/s per rank / fp32 matmul FLOP/s. Useful FLOPs:
  4bhs^2d forward (half when causal), backward 2.5x forward, divided by N. The
  matmul rate is measured on every rank at the same time (so it sees the same
  contention as the attention) with the kernel's own score product,
  [b*h, 512, d] @ [b*h, d, 512].
- balance = max / mean over ranks of the visible score-matrix entries each rank
  computes: from the layout's token positions for p2p, the head split for all2all.
- bytes_ratio = bytes sent per rank (paddle_cp.bytes_sent(), one forward+backward, the rank sending most)
  / the algorithm's minimum (`bytes_min`): the ring's planned exchange on the case's layout, k/v rows
  other ranks' tiles read forward and again backward, and their gradients (attention/layout/exchange_plan.py;
  whole blocks, 3(N-1) x bytes(local k, v), where nothing is masked); Ulysses 2 x (N-1)/N x
  bytes(q, k, v, out) (paddle_cp.cost.attention); hybrid the Ulysses figure over U ranks plus the
  ring's over N/U groups on h_k/U heads. `bytes_read`: the same with 3 x the k/v rows read for the ring.
- mem_ratio = peak bytes allocated per rank during forward+backward (inputs,
  activations, gradients, temporaries) / the same for one process running the same
  blockwise kernel on the whole sequence. Measured with Paddle's host allocator
  statistics, so it counts tensors only (not the Python heap or gloo buffers).
  `held_ratio` is the same for the bytes held between forward and backward,
  which cost/attention.py predicts (`held_predicted_ratio`).
- host_reads_per_step, collectives_per_step: of one forward+backward, on the rank with the most
  (tools/host_reads.py counts device values read on the host and copies in of host data: each stalls a
  GPU's queue; a ring exchange counts as one collective, and so does an all-to-all or reduce-scatter that
  gloo emulates with point-to-point rounds, as on NCCL). Printed in a second table.

On a machine with fewer cores than ranks the ranks share cores: T_rank and the
matmul rate are then both slowed, so kernel_util stays fair but efficiency
cannot reach 1 (the JSON records `oversubscribed`). On a machine other jobs load,
efficiency means little: T_single and T_rank are timed at different moments, under
whatever load each met; balance, bytes_ratio and mem_ratio are counts, not timings.

Packed documents (`--documents stdlib|lognormal|FILE`, tools/packing.py): each
case is a batch of `--batch` rows of packed documents (`--doc-batch` picks which
of the stream's batches), causal attention inside each document, run in both
layouts, `chunks` (2N equal chunks) beside `documents` (balanced by work):

    pcp-bench --nproc 4 --seq 4096 --backend p2p --documents stdlib

- work_imbalance (`balance`): max / mean over ranks of the keys their queries
  see (tools/packing.py), the quantity the documents layout balances;
- time_imbalance: max / mean over ranks of the seconds spent inside attention
  kernels (forward + backward, exchanges excluded; median over iterations);
- efficiency as above, T_single being Paddle's SDPA with the documents' dense
  block-diagonal causal mask (the blockwise kernel with the documents for
  `efficiency_same_kernel`).

With `--documents` it also prints (and writes under `gpu_model`) the GPU tile model's figures for the same
batches, no GPU needed (bench/gpu_layouts.py): the chosen layout beside 2R chunks and the whole-document
layout, predicted slowest-rank ms, tiles, tokens per rank, kernel calls per ring pass and host planning ms.
Then each layout's predicted step with its planned k/v exchange priced on the links (cost/links.py),
within one node and across nodes of `--ranks-per-node` ranks (default 1): the choice by tiles alone, the
link-priced choice and 2R chunks. Then the bytes each layout's ring exchange sends per rank and forward +
backward, computed from the layout (not measured): whole blocks to every member, the exchange plan's (only
the k/v rows other ranks' tiles read, what rotate='planned' sends), and the rows read x 3.
`--model-only` prints just those (any length: 128K-token rows take well under a second each):

    pcp-bench --documents lognormal --model-only --nproc 8 --seq 131072 262144 --backend p2p hybrid
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# absolute: the ranks run this file as a script
from paddle_cp.tools.bench.attention_figures import config, gpu_model, summarise_all, ulysses_degree
from paddle_cp.tools.bench.attention_ranks import measure_single, run_ranks
from paddle_cp.tools.launcher import THREAD_VARS, launch, progress

TABLE = ("efficiency", "kernel_util", "balance", "bytes_ratio", "mem_ratio")
EFFICIENCY_NOTE = ("efficiency compares T_single and T_rank, timed at different moments: on a machine other jobs load "
                   "it means little (kernel_util's two rates are timed together; balance, bytes_ratio, mem_ratio are "
                   "counts)")
DOCUMENT_TABLE = ("balance", "time_imbalance", "efficiency", "efficiency_same_kernel", "bytes_ratio")


MODES = """\
other benchmarks, each with its own flags (pcp-bench MODE --help):
  --pool                    the dp x sep pool against fixed dp x sep, priced by the GPU tile model (no ranks)
  --planning                host time to plan one layer's attention (no ranks)
  --vision                  vision-language batches, the vision tower split by images against others (no ranks)
  --mixer gated_deltanet    a Gated DeltaNet layer under context parallelism instead of attention
  --saves                   a training step under pcp.Resumable with async saves beside blocking ones and none
docs/tools.md explains every column."""


def parse_args(argv=None):
    from paddle_cp.tools.units import tokens  # here: the ranks run this file as a script

    from paddle_cp.tools.text import HelpFormatter

    parser = argparse.ArgumentParser(prog="pcp-bench", description=__doc__.split("\n\n")[0], epilog=MODES,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="context-parallel ranks (CPU processes)")
    parser.add_argument("--seq", type=tokens, nargs="+", default=[2048], help="sequence lengths (4K = 4096)")
    parser.add_argument("--backend", nargs="+", choices=["p2p", "all2all", "hybrid"], default=["p2p", "all2all"])
    parser.add_argument("--ulysses-degree", type=int, default=2, help="Ulysses group size of the hybrid backend")
    parser.add_argument("--causal", action="store_true", help="causal attention (default: full)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="k/v heads (GQA); default: --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3, help="timed repetitions (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--documents", metavar="LENGTHS",
                        help="packed documents: stdlib (the main job's), lognormal, longtail, uniform, single, "
                             "or a file of lengths")
    parser.add_argument("--doc-batch", type=int, default=0, help="which batch of the packed stream (default: first)")
    parser.add_argument("--ranks-per-node", type=int, default=1,
                        help="with --documents: ranks a node for the tile model's predicted steps across nodes")
    parser.add_argument("--model-only", action="store_true",
                        help="with --documents: only the GPU tile model's table of the layouts, no CPU ranks")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    parser.add_argument("--result-file", help=argparse.SUPPRESS)  # launcher <-> rank 0
    args = parser.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    args.causal = args.causal or args.documents is not None  # attention stays causal inside each document
    _check(parser, args)
    return args


def _check(parser, args):
    """Refuse bad shapes here, with the library's own checks, before any rank starts waiting for another."""
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout
    from paddle_cp.attention.algorithms.ulysses import head_split
    from paddle_cp.cost.attention import degrees

    from paddle_cp.tools.packing import document_lengths

    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.documents is not None:
        try:
            document_lengths(args.documents)
        except ValueError as error:
            parser.error(f"--documents: {error}")
        if args.doc_batch < 0:
            parser.error("--doc-batch takes a batch index >= 0")
    elif args.model_only:
        parser.error("--model-only prices packed documents' layouts: give --documents too")
    for backend in args.backend:
        try:
            _, ulysses = degrees(backend, args.nproc, ulysses_degree(args, backend))
            for seq in args.seq:
                SequenceLayout(backend, args.nproc, ulysses_degree(args, backend)).check_length(seq)
            head_split(args.heads, args.kv_heads, ulysses)
        except ValueError as error:
            parser.error(f"--backend {backend}: {error}")


def table(result):
    from paddle_cp.tools.bench import gpu_layouts
    from paddle_cp.tools.text import ruled_table  # here: the ranks run this file as a script

    documents = result["config"]["documents"] is not None
    if documents:
        rows = result["gpu_model"]
        model = "\n\n".join([gpu_layouts.table(rows), gpu_layouts.steps_table(rows), gpu_layouts.bytes_table(rows)])
    if not result["cases"]:
        return model

    metrics = DOCUMENT_TABLE if documents else TABLE
    layout = f" {'layout':9}" if documents else ""
    head = (f"{'backend':8}{layout} {'seq':>6} {'N':>2} {'T_single':>9} {'T_rank':>9}"
            + "".join(f" {m:>12}" for m in metrics))
    cpu = ruled_table(head, [
        f"{c['backend']:8}" + (f" {c['layout']:9}" if documents else "")
        + f" {c['seq']:>6} {c['nproc']:>2} {c['t_single']:>8.3f}s {c['t_rank']:>8.3f}s"
        + "".join(f" {c[m]:>12.3f}" for m in metrics) for c in result["cases"]])
    return cpu + ("\n\n" + model if documents else "")


def step_counts_table(result):
    """Per case: host reads and collectives of one forward+backward on the rank with the most."""
    from paddle_cp.tools.text import ruled_table

    head = f"{'backend':8} {'layout':9} {'seq':>6} {'N':>2} {'host reads/step':>16} {'collectives/step':>17}"
    return ruled_table(head, [f"{c['backend']:8} {c['layout'] or '-':9} {c['seq']:>6} {c['nproc']:>2} "
                              f"{c['host_reads_per_step']:>16} {c['collectives_per_step']:>17}"
                              for c in result["cases"]])


def plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib is not installed: no plot")
        return
    cases = result["cases"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(cases)
    for i, c in enumerate(cases):
        ax.bar([j + i * width for j in range(len(TABLE))], [c[m] for m in TABLE], width,
               label=f"{c['backend']} s={c['seq']} N={c['nproc']}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(TABLE))], TABLE)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def finish(result, args):
    from paddle_cp.tools.text import show  # here: the ranks run this file as a script

    note = "\n" + EFFICIENCY_NOTE if result["cases"] else ""
    show(table(result) + note + "\n\n" + step_counts_table(result), result, args.json)
    if args.plot:
        plot(result, args.plot)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    mixer = argparse.ArgumentParser(add_help=False)
    mixer.add_argument("--mixer", choices=["attention", "gated_deltanet"], default="attention")
    mixer.add_argument("--planning", action="store_true")
    mixer.add_argument("--pool", action="store_true")
    mixer.add_argument("--saves", action="store_true")
    mixer.add_argument("--vision", action="store_true")
    chosen, rest = mixer.parse_known_args(argv)
    if chosen.saves:  # a training step's time with async saves, blocking ones and none (bench/saves.py)
        from paddle_cp.tools.bench import saves as bench_saves

        bench_saves.main(rest)
        return
    if chosen.vision:  # a vision-language batch's vision tower split by images, priced (bench/vision.py)
        from paddle_cp.tools.bench import vision as bench_vision

        bench_vision.main(rest)
        return
    if chosen.pool:  # the dp x sep pool against fixed dp x sep, priced by the tile model (bench/pool.py)
        from paddle_cp.tools.bench import pool as bench_pool

        bench_pool.main(rest)
        return
    if chosen.planning:  # host time to plan one layer's attention, no launch (bench/planning.py)
        from paddle_cp.tools.bench import planning as bench_planning

        bench_planning.main(rest)
        return
    if chosen.mixer == "gated_deltanet":  # a Gated DeltaNet layer instead (bench/gdn.py)
        from paddle_cp.tools.bench import gdn as bench_gdn

        bench_gdn.main(rest)
        return
    argv = rest
    args = parse_args(argv)
    if args.model_only:
        finish({"config": config(args), "cases": [], "gpu_model": gpu_model(args)}, args)
        return
    if "PADDLE_TRAINER_ID" not in os.environ:
        os.environ.update({name: "1" for name in THREAD_VARS})  # one thread, like each rank (before paddle loads)
        single = measure_single(args)
        finish(summarise_all(args, single, launch(args, argv, script=__file__)), args)
        return
    measured = run_ranks(args)
    if measured is None:
        return
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(measured))
    else:  # run under someone else's launch: rank 0 measures the reference once the other ranks are done
        finish(summarise_all(args, measure_single(args), measured), args)


if __name__ == "__main__":
    main()
