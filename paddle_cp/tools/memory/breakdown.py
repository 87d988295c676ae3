"""pcp-memory's ranks: a PaddleFormers Llama's training step, per variant and global length, broken into the
parts each rank holds (the largest over ranks), and with --budget-mib the longest length whose step fits."""
from __future__ import annotations

from paddle_cp.cost.candidate import NO_RECOMPUTE, RECOMPUTE_FULL, Layout
from paddle_cp.tools.allocator import allocated
from paddle_cp.tools.launcher import progress
from paddle_cp.tools.memory.step import build_llama, step_parts
from paddle_cp.tools.plan.config import model_config
from paddle_cp.tools.ranks import max_over_ranks, sep_mesh, start_cpu_ranks

VARIANTS = {"plain": {}, "recompute": {"recompute": True}, "chunked": {"chunked": True},
            "recompute+chunked": {"recompute": True, "chunked": True}}
PARTS = ("params", "optimizer", "activations", "logits", "peak")
MIB = 2 ** 20


def _build(args, local_len, recompute=False, chunked=False):
    # PaddleFormers 1.2.0 chunks only sequences longer than the chunk, and its unchunked fallback
    # fails under recompute (parallel_matmul reads is_distributed of the detached weight)
    layout = Layout(recompute=RECOMPUTE_FULL if recompute else NO_RECOMPUTE,
                    loss_chunk=min(args.chunk, local_len - 1) if chunked else 0)
    return build_llama(args, **model_config(layout))


def measure(args, mesh, seq, recompute=False, chunked=False):
    """This rank's {part: bytes} for one training step at global length `seq`."""
    import gc

    import paddle

    import paddle_cp as pcp

    gc.collect()
    start = allocated()
    paddle.seed(0)
    world = 1 if args.no_cp else mesh.shape[0]
    model = _build(args, seq // world, recompute, chunked)
    opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())
    labels_of = lambda labels: labels  # noqa: E731 - one process keeps every label
    if not args.no_cp:
        prepare = pcp.PrepareContextParallel(args.backend)
        plan = {"model": prepare, "model.layers.*.self_attn": pcp.ContextParallel(args.backend)}
        model, opt = pcp.parallelize(model, opt, mesh, {"cp_config": {"parallelize_plan": plan}})
        labels_of = lambda labels: pcp.shard_sequence(labels, backend=prepare, mesh=mesh)  # noqa: E731
    params = allocated() - start
    ids = paddle.randint(0, args.vocab, [1, seq + 1])
    return step_parts(model, opt, {"input_ids": ids[:, :-1], "labels": labels_of(ids[:, 1:])}, start, params)


def breakdown(args, mesh, seq, variant):
    parts = measure(args, mesh, seq, **VARIANTS[variant])
    return dict(zip(PARTS, (int(v) for v in max_over_ranks([parts[p] for p in PARTS]))))


def longest_fit(args, mesh, variant, world):
    """The longest multiple of --granularity (>= 2N) whose step peaks within the budget on every rank."""
    budget = args.budget_mib * MIB
    unit = max(args.granularity, 2 * world)
    peaks = {}

    def fits(units):
        peaks[units * unit] = breakdown(args, mesh, units * unit, variant)["peak"]
        progress(f"N={world} {variant}: {units * unit} tokens peak {peaks[units * unit] / MIB:.1f} MiB")
        return peaks[units * unit] <= budget

    if not fits(1):
        return {"tokens": 0, "probes": peaks}
    lo, hi = 1, 2
    while fits(hi):  # double until a length does not fit
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"tokens": lo * unit, "probes": {str(k): v for k, v in sorted(peaks.items())}}


def run_ranks(args):
    """Every variant and length on this rank; rank 0 (or the single process) returns {"cases", "fits"}."""
    import paddle
    import paddle.distributed as dist

    if args.no_cp:  # the --single run: one process, no process group
        paddle.set_device("cpu")
        world, mesh = 1, None
    else:
        world = start_cpu_ranks()
        mesh = sep_mesh(world)
    label = "single" if args.no_cp else world
    cases = []
    for variant in args.variants:
        for seq in args.seq:
            progress(f"N={label} {variant}: seq {seq}")
            cases.append({"nproc": label, "variant": variant, "seq": seq, **breakdown(args, mesh, seq, variant)})
    fits = {}
    if args.budget_mib:
        for variant in args.fit_variants:
            fits[variant] = longest_fit(args, mesh, variant, world)
    return {"cases": cases, "fits": fits} if args.no_cp or dist.get_rank() == 0 else None
