"""Memory of a PaddleFormers Llama training step under context parallelism, per rank.

    pcp-memory --nproc 1 2 4 --seq 1024 --budget-mib 64 --json out.json
    (from a checkout: python tools/bench_memory.py ...)
    pcp-memory --phases ...: startup and I/O phases instead (tools/memory_phases.py)
    pcp-memory --experts ...: a MoE model with and without expert parallelism (tools/memory_experts.py)
    pcp-memory --layouts "dp2 ring2 l3@dp" ...: pcp-plan's layouts beside its estimate (tools/memory_layouts.py)
    pcp-memory --sharding ...: what each sharding level leaves a rank instead (tools/memory_sharding.py)

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

from paddle_cp.tools import memory_layouts
from paddle_cp.tools.allocator import allocated, peak, reset_peak
from paddle_cp.tools.launcher import launch, progress
from paddle_cp.tools.plan_config import model_config
from paddle_cp.tools.plan_layout import NO_RECOMPUTE, RECOMPUTE_FULL, Layout
from paddle_cp.tools.text import ruled_table, show
from paddle_cp.tools.units import tokens

VARIANTS = {"plain": {}, "recompute": {"recompute": True}, "chunked": {"chunked": True},
            "recompute+chunked": {"recompute": True, "chunked": True}}
PARTS = ("params", "optimizer", "activations", "logits", "peak")
MIB = 2 ** 20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
                        "each beside the planner's estimate (tools/memory_layouts.py), e.g. 'dp2 ring2 l3@dp'")
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


# ---- the rank side ----------------------------------------------------------------



def build_llama(args, **fields):
    """PaddleFormers' Llama of the flags' sizes, unfused RMSNorm (CPU), Paddle's SDPA unless `fields` say."""
    from paddle_cp.integrations import zoo

    pf = zoo.transformers()
    sizes = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)
    return pf.LlamaForCausalLM(pf.LlamaConfig(**sizes, fuse_rms_norm=False,
                                              **{"_attn_implementation": "sdpa", **fields}))


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


def step_parts(model, opt, inputs, start, params):
    """{part: bytes} of a training step on `inputs`, its state allocated since `start` (`params` of it by the
    model). `activations` and `logits` are None where the decoder's forward does not end inside `model(...)`'s
    forward (a pipeline runs forward and backward in one call)."""
    body_end = []
    model.model.register_forward_post_hook(lambda *_: body_end.append(allocated()))

    def step():
        loss = model(**inputs)[0]
        held = allocated()
        loss.backward()
        del loss
        opt.step()
        opt.clear_grad(set_to_zero=False)  # free the gradients: `optimizer` then counts AdamW's state alone
        return held

    loss = model(**inputs)[0]  # makes what the batch keeps (its attention plans and their device indices)
    loss.backward()
    del loss
    opt.clear_grad(set_to_zero=False)
    before = allocated()
    step()  # creates AdamW's state
    optimizer = allocated() - before
    base = allocated()
    body_end.clear()
    reset_peak()
    held = step()
    pipelined = not body_end or held < body_end[-1]
    return {"params": params, "optimizer": optimizer,
            "activations": None if pipelined else body_end[-1] - base,
            "logits": None if pipelined else held - body_end[-1], "peak": peak() - start}


def max_over_ranks(values):
    """Each of `values` (numbers) at its largest over the launched ranks."""
    import paddle
    import paddle.distributed as dist

    tensor = paddle.to_tensor(values, dtype="float64")
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.numpy().tolist()


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
    import paddle
    import paddle.distributed as dist

    paddle.set_device("cpu")
    if not args.no_cp:
        dist.init_parallel_env()
    world = dist.get_world_size() if not args.no_cp else 1
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"]) if not args.no_cp else None
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
        from paddle_cp.tools.memory_phases import main as phases_main

        return phases_main(argv)
    if "--experts" in argv:  # a MoE model with and without expert parallelism: its own tool
        from paddle_cp.tools.memory_experts import main as experts_main

        return experts_main(argv)
    if "--sharding" in argv:  # sharding levels on a context-parallel mesh: their own tool
        from paddle_cp.tools.memory_sharding import main as sharding_main

        return sharding_main(argv)
    args = parse_args(argv)
    tool = memory_layouts if args.layouts else sys.modules[__name__]
    if "PADDLE_TRAINER_ID" not in os.environ and not args.no_cp:
        result = tool.collect(args, argv)
        show(tool.table(result), result, args.json)
        return
    result = tool.run_ranks(args)
    if result is not None:
        Path(args.result_file).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
