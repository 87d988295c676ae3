"""pcp-bench --saves: what resumability costs a training step, in one run: a PaddleFormers Llama under ring
attention trained in a plain loop, under pcp.Resumable without periodic saves (the step boundary's agreement
alone: one all-reduce of 8 bytes per step), with an async save every --save-every steps, and with a blocking
one, each --rounds times in the order A B C D A B C D ... so that drift of the machine's load falls on all alike.

    pcp-bench --saves --nproc 2 --steps 30 --save-every 10

Per variant, the slowest rank's mean per step, the least over the rounds (a round another process slowed counts
least), and its ratio to the plain loop's: `step_ms`, wall time between step starts (the boundary and any save
inside it); `cpu_ms`, the CPU time of the rank's process over those steps, the writer thread's included, which
the machine's other load does not change. Beside them, the host memory the async copy
holds: `copy_bytes`, the bytes of the boxes this rank writes (what the save clones before the writer thread
runs: parameters and AdamW's two moments, each piece by one holder), and `held_bytes`, what Paddle's host
allocator held above its level during one async save (its peak). On a GPU that copy is a device-to-host
transfer of copy_bytes (`gpu_copy_ms`: at 25 GB/s, PCIe 4 x16), issued from the step that saves.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script by the launch: import the package from its root
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from paddle_cp.integrations import zoo  # noqa: E402
from paddle_cp.tools.launcher import progress, tool_main  # noqa: E402
from paddle_cp.tools.ranks import gather, sep_mesh, start_cpu_ranks  # noqa: E402
from paddle_cp.tools.text import ruled_table  # noqa: E402

VARIANTS = ("plain loop", "Resumable, no saves", "async save every k", "blocking save every k")
PCIE_BYTES_PER_S = 25e9


def parse_args(argv=None):
    from paddle_cp.tools.units import tokens  # here: the ranks run this file as a script

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="context-parallel ranks (CPU processes)")
    parser.add_argument("--seq", type=tokens, default=1024, help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each variant, each round")
    parser.add_argument("--save-every", type=int, default=10, help="k: steps between saves")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=3, help="times each variant runs (the least counts)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--result-file", help=argparse.SUPPRESS)  # launcher <-> rank 0
    args = parser.parse_args(argv)
    if args.steps < 2 or args.save_every < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps takes >= 2, --save-every >= 1, --warmup >= 0, --rounds >= 1")
    return args


def build(args, mesh):
    import paddle

    import paddle_cp as pcp

    library = zoo.transformers()
    paddle.seed(0)
    model = library.LlamaForCausalLM(library.LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq, fuse_rms_norm=False))
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    plan = {"": pcp.PrepareContextParallel("p2p"), "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    return pcp.parallelize(model, optimizer, mesh, {"cp_config": {"parallelize_plan": plan}})


def train_step(model, optimizer, ids):
    loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:])[0]
    loss.backward()
    optimizer.step()
    optimizer.clear_grad()


def timed_run(variant, args, model, optimizer, ids, root):
    """(wall, CPU) seconds per step of `variant` over --steps steps (after --warmup; one more step's start ends the
    last, so the save a Resumable makes at its end is not timed)."""
    import paddle_cp as pcp

    starts, steps = [], args.warmup + args.steps + 1
    if variant == VARIANTS[0]:
        for _ in range(steps):
            starts.append((time.perf_counter(), time.process_time()))
            train_step(model, optimizer, ids)
    else:
        with pcp.Resumable(root, model, optimizer, save_every=0 if variant == VARIANTS[1] else args.save_every,
                           keep_latest=1, fresh=True, async_save=variant != VARIANTS[3]) as run:
            for _ in run.steps(steps):
                starts.append((time.perf_counter(), time.process_time()))
                train_step(model, optimizer, ids)
    (wall0, cpu0), (wall1, cpu1) = starts[args.warmup], starts[-1]
    return (wall1 - wall0) / args.steps, (cpu1 - cpu0) / args.steps


def run_ranks(args):
    import paddle
    import paddle.distributed as dist

    import paddle_cp as pcp
    from paddle_cp.checkpoint import shards
    from paddle_cp.tools import allocator

    world = start_cpu_ranks(args.nproc)
    model, optimizer = build(args, sep_mesh(world))
    paddle.seed(1)
    ids = paddle.randint(0, 256, [1, args.seq + 1])
    root = Path(args.result_file).parent / "checkpoints"  # the launch's folder: the same on every rank
    seconds = {variant: [] for variant in VARIANTS}
    for round_ in range(args.rounds):
        for variant in VARIANTS:
            progress(f"round {round_ + 1}: {variant}")
            seconds[variant].append(timed_run(variant, args, model, optimizer, ids, str(root / "run")))
    copy_bytes = sum(box.nbytes for _, box in shards.model_boxes(model) + shards.optimizer_boxes(model, optimizer))
    before = allocator.allocated()
    allocator.reset_peak()
    pcp.save_checkpoint(str(root / "held"), model, optimizer, async_save=True)
    held = allocator.peak() - before
    pcp.wait_checkpoint()
    least = [min(times[kind] for times in seconds[variant]) for kind in (0, 1) for variant in VARIANTS]
    gathered = gather([*least, copy_bytes, held])  # every rank: a collective
    return {"ranks": gathered} if dist.get_rank() == 0 else None


def summarise(args, measured):
    ranks, n = measured["ranks"], len(VARIANTS)
    slowest = [max(rank[i] for rank in ranks) for i in range(2 * n)]
    wall, cpu = slowest[:n], slowest[n:]
    copy_bytes, held = max(rank[-2] for rank in ranks), max(rank[-1] for rank in ranks)
    rows = [{"variant": variant, "step_ms": 1e3 * w, "ratio": w / wall[0], "cpu_ms": 1e3 * c, "cpu_ratio": c / cpu[0]}
            for variant, w, c in zip(VARIANTS, wall, cpu)]
    return {"config": vars(args), "rows": rows, "copy_bytes": copy_bytes, "held_bytes": held,
            "gpu_copy_ms": 1e3 * copy_bytes / PCIE_BYTES_PER_S}


def table(result):
    args = result["config"]
    head = f"{'variant':<24} {'step ms':>9} {'vs plain':>9} {'cpu ms':>9} {'vs plain':>9}"
    rows = [f"{row['variant']:<24} {row['step_ms']:9.1f} {row['ratio']:9.3f} {row['cpu_ms']:9.1f} "
            f"{row['cpu_ratio']:9.3f}" for row in result["rows"]]
    return (ruled_table(head, rows) + f"\n\n{args['nproc']} ranks, {args['steps']} timed steps, the least of "
            f"{args['rounds']} rounds, a save every "
            f"{args['save_every']} steps (k); async copy held on the host: {result['copy_bytes'] / 2**20:.1f} MiB of "
            f"boxes per rank, allocator peak +{result['held_bytes'] / 2**20:.1f} MiB during a save; on a GPU "
            f"the copy is {result['gpu_copy_ms']:.1f} ms of PCIe (25 GB/s)")


def main(argv=None):
    tool_main(argv, parse_args, run_ranks, summarise, table, __file__)


if __name__ == "__main__":
    main()
