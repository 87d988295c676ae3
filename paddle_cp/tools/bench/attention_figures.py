"""pcp-bench's figures (attention), computed where the ranks were launched: each case's per-rank work, the
bytes its algorithm needs at least, the summary of the ranks' measurements against the one-process reference,
and the GPU tile model's rows of a --documents run."""
from __future__ import annotations

import os
import statistics

from paddle_cp.tools.launcher import progress


def ulysses_degree(args, backend):
    return args.ulysses_degree if backend == "hybrid" else None


def case_documents(args, seq):
    """The case's packed documents (a Documents) and their position ids, or (None, None)."""
    from paddle_cp.attention.masks.block_mask import Documents
    from paddle_cp.tools.packing import batches

    if args.documents is None:
        return None, None
    positions = batches(args.documents, seq, args.batch, args.doc_batch + 1)[args.doc_batch]
    return Documents.from_position_ids(positions), positions


def summarise_all(args, single, measured):
    cases = [summarise(args, backend, seq, single["by_seq"][seq], single["rate"], per_rank, measured["rates"], split)
             for seq, backend, split, per_rank in measured["runs"]]
    result = {"config": config(args), "cases": cases}
    if args.documents is not None:
        result["gpu_model"] = gpu_model(args)
    return result


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
        return work_per_rank(backend, args.nproc, seq, args.heads, args.causal, ulysses_degree(args, backend))
    documents, positions = case_documents(args, seq)
    layout = SequenceLayout(backend, args.nproc, ulysses_degree(args, backend)).for_batch(documents, split)
    return packing.rank_work(layout, positions)


def _bytes_min(args, backend, seq, split):
    """(bytes, bytes read) of the rank sending most in one forward+backward: the Ulysses all-to-alls' bytes
    (cost/attention.py) plus the ring's planned exchange on the case's layout (exchange_plan: only the k/v rows
    other members' tiles read, and their gradients); `bytes read` puts 3 x those rows in its place."""
    from paddle_cp.attention.layout.exchange_plan import ExchangePlan, exchange_bytes
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout
    from paddle_cp.cost import attention as attention_cost

    ring, ulysses = attention_cost.degrees(backend, args.nproc, ulysses_degree(args, backend))
    inner = attention_cost.ulysses_bytes(args.batch, seq // ring, args.heads, args.kv_heads, args.head_dim, ulysses)
    if ring == 1:
        return inner, inner
    documents, _ = case_documents(args, seq) if split is not None else (None, None)
    layout = SequenceLayout(backend, args.nproc, ulysses_degree(args, backend))
    layout = layout.for_batch(documents, split) if split is not None else layout
    ring_heads = attention_cost.ring_kv_heads(args.heads, args.kv_heads, ulysses)
    row_bytes = args.batch * ring_heads * 2 * args.head_dim * attention_cost.FP32
    sent = exchange_bytes(ExchangePlan(layout.ring_positions(seq), args.causal, documents), row_bytes, row_bytes)
    return inner + int(sent.planned.max()), inner + int(sent.read.max())


def summarise(args, backend, seq, single, single_rate, per_rank, rates, split=None):
    from paddle_cp.cost import attention as attention_cost

    n, degree = args.nproc, ulysses_degree(args, backend)
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


def config(args):
    return {"nproc": args.nproc, "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "causal": args.causal, "iters": args.iters, "dtype": "float32",
            "threads_per_rank": 1, "cpu_count": os.cpu_count(), "documents": args.documents,
            "doc_batch": args.doc_batch}


def gpu_model(args):
    """The tile model's rows (bench/gpu_layouts.py) for every length and backend of a --documents run."""
    from paddle_cp.tools.bench import gpu_layouts

    rows = []
    for seq in args.seq:
        _, positions = case_documents(args, seq)
        for backend in args.backend:
            progress(f"seq {seq}: {backend} layouts priced by the GPU tile model")
            rows += [dict(row, documents=args.documents)
                     for row in gpu_layouts.layout_rows(positions, backend, args.nproc, ulysses_degree(args, backend),
                                                        _kv_row_bytes(args, backend), args.ranks_per_node)]
    return rows


def _kv_row_bytes(args, backend):
    """One token's fp32 k and v on one rank (mean over a Ulysses group's head shares), over the batch rows."""
    from paddle_cp.attention.algorithms.ulysses import head_split
    from paddle_cp.cost.attention import degrees

    _, ulysses = degrees(backend, args.nproc, ulysses_degree(args, backend))
    kv_heads = sum(head_split(args.heads, args.kv_heads, ulysses).kv_counts) / ulysses
    return args.batch * kv_heads * 2 * args.head_dim * 4
