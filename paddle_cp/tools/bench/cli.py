"""Benchmark context-parallel attention against one process doing the whole sequence.

    pcp-bench --nproc 2 --seq 2048 --backend p2p --causal --json out.json
    pcp-bench --mixer gated_deltanet --nproc 2 4 --seq 2048    (a Gated DeltaNet layer: bench/gdn.py)
    pcp-bench --planning --nproc 8 --seq 131072 --documents lognormal   (host planning: bench/planning.py)
    pcp-bench --pool --dp 2 --sep 4 --seq 64K --documents lognormal   (dp x sep pool against fixed: bench/pool.py)

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
import statistics
import sys
import time
from pathlib import Path

# absolute: the ranks run this file as a script
from paddle_cp.tools.launcher import THREAD_VARS, gather, launch, median_time, progress

TABLE = ("efficiency", "kernel_util", "balance", "bytes_ratio", "mem_ratio")
EFFICIENCY_NOTE = ("efficiency compares T_single and T_rank, timed at different moments: on a machine other jobs load "
                   "it means little (kernel_util's two rates are timed together; balance, bytes_ratio, mem_ratio are "
                   "counts)")
DOCUMENT_TABLE = ("balance", "time_imbalance", "efficiency", "efficiency_same_kernel", "bytes_ratio")
DOCUMENT_LAYOUTS = ("chunks", "documents")  # old beside new
MATMUL_BLOCK = 512  # BlockwiseKernel's default block: the matmul the kernel really does


def parse_args(argv=None):
    from paddle_cp.tools.units import tokens  # here: the ranks run this file as a script

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
            _, ulysses = degrees(backend, args.nproc, _degree(args, backend))
            for seq in args.seq:
                SequenceLayout(backend, args.nproc, _degree(args, backend)).check_length(seq)
            head_split(args.heads, args.kv_heads, ulysses)
        except ValueError as error:
            parser.error(f"--backend {backend}: {error}")


def _degree(args, backend):
    return args.ulysses_degree if backend == "hybrid" else None


# ---- the rank side ----------------------------------------------------------------

def run_ranks(args):
    import paddle
    import paddle.distributed as dist

    import paddle_cp as pcp

    paddle.set_device("cpu")
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.nproc:
        raise ValueError(f"launched on {world} ranks but --nproc is {args.nproc}")
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    pcp.shard_sequence(paddle.zeros([1, 2 * world]), mesh=mesh)  # create the sep groups before timing

    progress("timing the fp32 matmul on every rank")
    rates = gather([_matmul_rate(paddle, args)])
    runs = []
    for seq in args.seq:
        inputs = _inputs(paddle, args, seq)
        for backend in args.backend:
            for split in _layouts(args):
                progress(f"seq {seq}: {backend}{' ' + split if split else ''} on {world} ranks")
                measured = _context_parallel(paddle, dist, pcp, mesh, args, backend, inputs, split)
                runs.append([seq, backend, split, gather(measured)])
    return {"rates": rates, "runs": runs} if rank == 0 else None


def _layouts(args):
    return DOCUMENT_LAYOUTS if args.documents is not None else (None,)


def _documents(args, seq):
    """The case's packed documents (a Documents) and their position ids, or (None, None)."""
    from paddle_cp.attention.masks.block_mask import Documents
    from paddle_cp.tools.packing import batches

    if args.documents is None:
        return None, None
    positions = batches(args.documents, seq, args.batch, args.doc_batch + 1)[args.doc_batch]
    return Documents.from_position_ids(positions), positions


def measure_single(args):
    """The single-process reference: the matmul rate, and per length SDPA and blockwise timings and memory."""
    import paddle

    paddle.set_device("cpu")
    progress("single-process reference")
    single = {"rate": _matmul_rate(paddle, args), "by_seq": {}}
    for seq in args.seq:
        progress(f"seq {seq}: single-process reference")
        single["by_seq"][seq] = _single(paddle, args, _inputs(paddle, args, seq))
    return single


def summarise_all(args, single, measured):
    cases = [summarise(args, backend, seq, single["by_seq"][seq], single["rate"], per_rank, measured["rates"], split)
             for seq, backend, split, per_rank in measured["runs"]]
    result = {"config": _config(args), "cases": cases}
    if args.documents is not None:
        result["gpu_model"] = gpu_model(args)
    return result


def _matmul_rate(paddle, args):
    a = paddle.randn([args.batch * args.heads, MATMUL_BLOCK, args.head_dim])
    b = paddle.randn([args.batch * args.heads, args.head_dim, MATMUL_BLOCK])
    flops = 2 * a.shape[0] * MATMUL_BLOCK * MATMUL_BLOCK * args.head_dim
    seconds = median_time(lambda: paddle.matmul(a, b), iters=20, warmup=3)
    return flops / seconds


def _inputs(paddle, args, seq):
    paddle.seed(seq)
    q = paddle.randn([args.batch, seq, args.heads, args.head_dim])
    k, v = (paddle.randn([args.batch, seq, args.kv_heads, args.head_dim]) for _ in range(2))
    return q, k, v, paddle.randn(q.shape)


def _fwd_bwd(paddle, attention, q, k, v, dout):
    leaves = [t.detach() for t in (q, k, v)]
    for t in leaves:
        t.stop_gradient = False
    return paddle.grad([attention(*leaves)], leaves, [dout])


def _memory(paddle, attention, q, k, v, dout):
    """(peak, held) bytes allocated by Paddle for one forward+backward, inputs included."""
    from paddle_cp.tools.allocator import allocated, peak, reset_peak

    base = allocated()
    reset_peak()
    leaves = [t.clone() for t in (q, k, v)]
    for t in leaves:
        t.stop_gradient = False
    out = attention(*leaves)
    held = allocated() - base
    grads = paddle.grad([out], leaves, [dout.clone()])
    most = peak() - base
    del grads, out
    return most, held


def _single(paddle, args, inputs):
    import numpy as np
    import paddle.nn.functional as F

    from paddle_cp.attention.kernels import local_attention
    from paddle_cp.attention.masks.block_mask import BlockMask

    seq = inputs[0].shape[1]
    documents, _ = _documents(args, seq)
    dense = mask = None
    if documents is not None:  # one card sees packed documents as a block-diagonal causal mask
        rows = np.arange(seq)[:, None]
        dense = paddle.to_tensor(((documents.start[:, None, :, None] <= np.arange(seq)) & (np.arange(seq) <= rows)))
        mask = BlockMask(np.arange(seq), np.arange(seq), True, documents)

    def sdpa(q, k, v):
        if dense is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)

    def blockwise(q, k, v):
        return local_attention(q, k, v, args.causal, args.head_dim ** -0.5, mask=mask)

    q, k, v, dout = inputs
    t_sdpa = median_time(lambda: _fwd_bwd(paddle, sdpa, *inputs), args.iters, args.warmup)
    t_blockwise = median_time(lambda: _fwd_bwd(paddle, blockwise, *inputs), args.iters, args.warmup)
    peak, held = _memory(paddle, blockwise, *inputs)
    return {"t_sdpa": t_sdpa, "t_blockwise": t_blockwise, "peak": peak, "held": held}


def _context_parallel(paddle, dist, pcp, mesh, args, backend, inputs, split=None):
    """[seconds, bytes sent, peak bytes, held bytes, kernel seconds] of this rank for one forward+backward;
    `split`: the layout of a packed-document case."""
    shards, attention = (_document_attention if split else _functional_attention)(pcp, mesh, args, backend, inputs,
                                                                                   split)
    pcp.reset_counters()
    _fwd_bwd(paddle, attention, *shards)
    sent = sum(pcp.bytes_sent().values())
    clock = _KernelClock()
    with clock:
        seconds = median_time(lambda: _fwd_bwd(paddle, attention, *shards), args.iters, args.warmup,
                               lambda: clock.lap() or dist.barrier())
    dist.barrier()
    peak, held = _memory(paddle, attention, *shards)
    return [seconds, sent, peak, held, clock.median(args.warmup), *_step_counts(paddle, attention, shards)]


def _step_counts(paddle, attention, shards):
    """[host reads, collectives] of one forward+backward on this rank: what a GPU step would wait for
    (tools/host_reads.py: reads and copies in of host data) and the collectives it would issue."""
    from paddle_cp.comm import counters
    from paddle_cp.tools import host_reads

    counters.reset()
    with host_reads.counting() as reads:
        _fwd_bwd(paddle, attention, *shards)
    return [reads.total(), sum(counters.collectives_issued().values())]


def _functional_attention(pcp, mesh, args, backend, inputs, split):
    degree = _degree(args, backend)
    shards = [pcp.shard_sequence(t, backend=backend, mesh=mesh, ulysses_degree=degree) for t in inputs]
    attention_fn = {"p2p": pcp.ring_attention, "all2all": pcp.ulysses_attention, "hybrid": pcp.hybrid_attention}[backend]
    extra = {"ulysses_degree": degree} if degree else {}
    seq_len = inputs[0].shape[1]  # each rank sees only its own part of a length that may not divide

    def attention(q, k, v):
        return attention_fn(q, k, v, is_causal=args.causal, mesh=mesh, seq_len=seq_len, **extra)

    return shards, attention


def _document_attention(pcp, mesh, args, backend, inputs, split):
    """The batch's layout in `split` (what PrepareContextParallel(layout=split) makes of it), its shards and
    the attention over them."""
    from paddle_cp.attention import context_parallel_attention, resolve_groups
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout

    seq_len = inputs[0].shape[1]
    documents, _ = _documents(args, seq_len)
    layout = SequenceLayout(backend, args.nproc, _degree(args, backend)).for_batch(documents, split)
    groups = resolve_groups(layout, mesh)
    shards = [layout.shard(t, 1, groups.sep.index) for t in inputs]

    def attention(q, k, v):
        return context_parallel_attention(layout, groups, q, k, v, is_causal=True, seq_len=seq_len,
                                          documents=documents)

    return shards, attention


class _KernelClock:
    """Seconds this rank spends inside attention kernels (the ring's forward and backward calls, exchanges
    excluded), per timed repetition: CPU kernels run synchronously, so the host clock measures them."""

    def __init__(self):
        from paddle_cp.attention.algorithms import ring

        self._ring, self._laps, self._seconds = ring, [], 0.0

    def __enter__(self):
        select = self._original = self._ring.select_kernel
        clock = self

        class Timed:
            def __init__(self, kernel):
                self.kernel = kernel

            def forward(self, *args):
                return clock._timed(self.kernel.forward, args)

            def backward(self, *args):
                return clock._timed(self.kernel.backward, args)

        self._ring.select_kernel = lambda *args: Timed(select(*args))
        return self

    def __exit__(self, *exc):
        self._ring.select_kernel = self._original
        self.lap()

    def _timed(self, call, args):
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self._seconds += time.perf_counter() - start

    def lap(self):
        """Close the current repetition (called before each one starts, and at the end)."""
        self._laps.append(self._seconds)
        self._seconds = 0.0

    def median(self, warmup):
        return statistics.median(self._laps[1 + warmup:])  # lap 0 closes before the first repetition


# ---- figures ----------------------------------------------------------------------

def work_per_rank(backend, world, seq, heads, causal, ulysses_degree=None):
    """Visible score-matrix entries each rank computes (per batch element): the rows of its ring
    group (the p2p layout over groups of U adjacent ranks) times its share of the heads."""
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout, even_sizes
    from paddle_cp.cost.attention import degrees

    ring, ulysses = degrees(backend, world, ulysses_degree)
    head_counts, groups = even_sizes(heads, ulysses), SequenceLayout("p2p", ring)
    work = []
    for index in range(world):
        rows = groups.positions(seq, index // ulysses)
        visible = int((rows + 1).sum()) if causal else len(rows) * seq
        work.append(head_counts[index % ulysses] * visible)
    return work


def _work(args, backend, seq, split):
    """Per-rank work: the layout's for a packed-document case, else visible score entries."""
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout
    from paddle_cp.tools import packing

    if split is None:
        return work_per_rank(backend, args.nproc, seq, args.heads, args.causal, _degree(args, backend))
    documents, positions = _documents(args, seq)
    layout = SequenceLayout(backend, args.nproc, _degree(args, backend)).for_batch(documents, split)
    return packing.rank_work(layout, positions)


def _bytes_min(args, backend, seq, split):
    """(bytes, bytes read) of the rank sending most in one forward+backward: the Ulysses all-to-alls' bytes
    (cost/attention.py) plus the ring's planned exchange on the case's layout (exchange_plan: only the k/v rows
    other members' tiles read, and their gradients); `bytes read` puts 3 x those rows in its place."""
    from paddle_cp.attention.layout.exchange_plan import ExchangePlan, exchange_bytes
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout
    from paddle_cp.cost import attention as attention_cost

    ring, ulysses = attention_cost.degrees(backend, args.nproc, _degree(args, backend))
    inner = attention_cost.ulysses_bytes(args.batch, seq // ring, args.heads, args.kv_heads, args.head_dim, ulysses)
    if ring == 1:
        return inner, inner
    documents, _ = _documents(args, seq) if split is not None else (None, None)
    layout = SequenceLayout(backend, args.nproc, _degree(args, backend))
    layout = layout.for_batch(documents, split) if split is not None else layout
    ring_heads = attention_cost.kv_heads_sent(args.heads, args.kv_heads, ulysses) // ulysses
    row_bytes = args.batch * ring_heads * 2 * args.head_dim * attention_cost.FP32
    sent = exchange_bytes(ExchangePlan(layout.ring_positions(seq), args.causal, documents), row_bytes, row_bytes)
    return inner + int(sent.planned.max()), inner + int(sent.read.max())


def summarise(args, backend, seq, single, single_rate, per_rank, rates, split=None):
    from paddle_cp.cost import attention as attention_cost

    n, degree = args.nproc, _degree(args, backend)
    shape = (args.batch, seq, args.heads, args.kv_heads, args.head_dim)
    t_rank = max(r[0] for r in per_rank)
    sent = max(r[1] for r in per_rank)
    flops = attention_cost.attention_flops(args.batch, seq, args.heads, args.head_dim, args.causal)
    work = _work(args, backend, seq, split)
    kernel_seconds = [r[4] for r in per_rank]
    predicted, read = _bytes_min(args, backend, seq, split)
    held_single = attention_cost.attention_held_bytes(backend, *shape, 1)
    return {
        "backend": backend, "ulysses_degree": degree, "seq": seq, "nproc": n, "causal": args.causal,
        "layout": split, "documents": args.documents, "kernel_seconds": kernel_seconds,
        "time_imbalance": max(kernel_seconds) / statistics.mean(kernel_seconds),
        "t_single": single["t_sdpa"], "t_single_blockwise": single["t_blockwise"], "t_rank": t_rank,
        "efficiency": single["t_sdpa"] / (n * t_rank),
        "efficiency_same_kernel": single["t_blockwise"] / (n * t_rank),
        "kernel_util": flops / n / t_rank / statistics.mean(r[0] for r in rates),
        "kernel_util_single": flops / single["t_sdpa"] / single_rate,
        "matmul_gflops": statistics.mean(r[0] for r in rates) / 1e9,
        "balance": max(work) / statistics.mean(work),
        "bytes_per_rank": sent,
        "bytes_min": predicted,
        "bytes_ratio": sent / predicted,
        "bytes_read": read,
        "mem_ratio": max(r[2] for r in per_rank) / single["peak"],
        "held_ratio": max(r[3] for r in per_rank) / single["held"],
        "held_predicted_ratio": (attention_cost.attention_held_bytes(backend, *shape, n, ulysses_degree=degree)
                                 / held_single),
        "peak_bytes_rank": max(r[2] for r in per_rank), "peak_bytes_single": single["peak"],
        "oversubscribed": n > (os.cpu_count() or 1),
        **_per_step(per_rank),
    }


def _per_step(per_rank):
    """The most host reads and collectives any rank had in one forward+backward (_step_counts)."""
    return {"host_reads_per_step": max(int(r[5]) for r in per_rank),
            "collectives_per_step": max(int(r[6]) for r in per_rank)}


def _config(args):
    return {"nproc": args.nproc, "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "causal": args.causal, "iters": args.iters, "dtype": "float32",
            "threads_per_rank": 1, "cpu_count": os.cpu_count(), "documents": args.documents,
            "doc_batch": args.doc_batch}


def gpu_model(args):
    """The tile model's rows (bench/gpu_layouts.py) for every length and backend of a --documents run."""
    from paddle_cp.tools.bench import gpu_layouts

    rows = []
    for seq in args.seq:
        _, positions = _documents(args, seq)
        for backend in args.backend:
            progress(f"seq {seq}: {backend} layouts priced by the GPU tile model")
            rows += [dict(row, documents=args.documents)
                     for row in gpu_layouts.layout_rows(positions, backend, args.nproc, _degree(args, backend),
                                                        _kv_row_bytes(args, backend), args.ranks_per_node)]
    return rows


def _kv_row_bytes(args, backend):
    """One token's fp32 k and v on one rank (mean over a Ulysses group's head shares), over the batch rows."""
    from paddle_cp.attention.algorithms.ulysses import head_split
    from paddle_cp.cost.attention import degrees

    _, ulysses = degrees(backend, args.nproc, _degree(args, backend))
    kv_heads = sum(head_split(args.heads, args.kv_heads, ulysses).kv_counts) / ulysses
    return args.batch * kv_heads * 2 * args.head_dim * 4


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
    chosen, rest = mixer.parse_known_args(argv)
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
        finish({"config": _config(args), "cases": [], "gpu_model": gpu_model(args)}, args)
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
