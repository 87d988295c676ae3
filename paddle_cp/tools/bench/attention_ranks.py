"""pcp-bench's ranks (attention): what each launched rank runs, and the one-process reference.

Each rank builds the case's q, k, v from the length's seed, shards them (by PrepareContextParallel's layout, or
a packed-document case's layout), times forward+backward (the kernels' own seconds apart), counts the bytes it
sent, the allocator's peak and held bytes, host reads and collectives of one step; the launching process (or
rank 0 after the others) times the same inputs on one process with Paddle's SDPA and the blockwise kernel.
"""
from __future__ import annotations

import statistics
import time

from paddle_cp.tools.bench.attention_figures import case_documents, ulysses_degree
from paddle_cp.tools.launcher import progress
from paddle_cp.tools.ranks import gather, median_time, seeded_normal, sep_mesh, start_cpu_ranks

DOCUMENT_LAYOUTS = ("chunks", "documents")  # old beside new
MATMUL_BLOCK = 512  # BlockwiseKernel's default block: the matmul the kernel really does


def run_ranks(args):
    """This rank's measurements of every case; rank 0 returns every rank's ({"rates", "runs"}), the others None."""
    import paddle
    import paddle.distributed as dist

    import paddle_cp as pcp

    world = start_cpu_ranks(args.nproc)
    mesh = sep_mesh(world)
    pcp.shard_sequence(paddle.zeros([1, 2 * world]), mesh=mesh)  # create the sep groups before timing

    progress("timing the fp32 matmul on every rank")
    rates = gather([_matmul_rate(paddle, args)])
    runs = []
    for seq in args.seq:
        inputs = _inputs(args, seq)
        for backend in args.backend:
            for split in _layouts(args):
                progress(f"seq {seq}: {backend}{' ' + split if split else ''} on {world} ranks")
                measured = _context_parallel(paddle, dist, pcp, mesh, args, backend, inputs, split)
                runs.append([seq, backend, split, gather(measured)])
    return {"rates": rates, "runs": runs} if dist.get_rank() == 0 else None


def _layouts(args):
    return DOCUMENT_LAYOUTS if args.documents is not None else (None,)


def measure_single(args):
    """The single-process reference: the matmul rate, and per length SDPA and blockwise timings and memory."""
    import paddle

    paddle.set_device("cpu")
    progress("single-process reference")
    single = {"rate": _matmul_rate(paddle, args), "by_seq": {}}
    for seq in args.seq:
        progress(f"seq {seq}: single-process reference")
        single["by_seq"][seq] = _single(paddle, args, _inputs(args, seq))
    return single


def _matmul_rate(paddle, args):
    a = paddle.randn([args.batch * args.heads, MATMUL_BLOCK, args.head_dim])
    b = paddle.randn([args.batch * args.heads, args.head_dim, MATMUL_BLOCK])
    flops = 2 * a.shape[0] * MATMUL_BLOCK * MATMUL_BLOCK * args.head_dim
    seconds = median_time(lambda: paddle.matmul(a, b), iters=20, warmup=3)
    return flops / seconds


def _inputs(args, seq):
    """q, k, v and the output's gradient, seeded by the length."""
    q_shape, kv_shape = [args.batch, seq, args.heads, args.head_dim], [args.batch, seq, args.kv_heads, args.head_dim]
    return seeded_normal(seq, q_shape, kv_shape, kv_shape, q_shape)


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
    documents, _ = case_documents(args, seq)
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
    degree = ulysses_degree(args, backend)
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
    documents, _ = case_documents(args, seq_len)
    layout = SequenceLayout(backend, args.nproc, ulysses_degree(args, backend)).for_batch(documents, split)
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
