"""`pcp-memory --layouts`: planned layouts' memory per rank, measured, beside the planner's estimate.

    pcp-memory --layouts "dp2 ring2 l3@dp" "tp2 ring2" "pp2 ring2 m2" --seq 1024 --json out.json

Each layout is named as pcp-plan names it (cost/candidate.py's Layout.parse) and must use the same number of
ranks; one launch of that many CPU ranks trains pcp-memory's PaddleFormers Llama (its size flags, fp32,
unfused RMSNorm) one step per layout and length, with the config pcp-plan writes for the layout
(plan/config.py: the parallelize YAML and the PaddleFormers fields), and reports per rank, the largest over
ranks, what pcp-memory reports (params, optimizer, activations, logits, peak; a pipeline runs its
forward and backward inside one call, so it has a peak only) and the host memory held: for `offload`
layouts the most bytes OffloadRecomputeInputs kept there at once, for `host-optimizer` ones the optimizer state
(dp_config offload_optimizer) after the step. The launching process puts the planner's
estimate for the same layout (cost/memory.py's memory, fp32) beside each figure and their ratio.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from paddle_cp.cost.memory import measured_parts, memory
from paddle_cp.cost.model_shape import ModelShape
from paddle_cp.cost.candidate import Layout
from paddle_cp.tools.text import ruled_table

PARTS = ("params", "optimizer", "activations", "logits", "peak", "host")
MEMORY_SCRIPT = Path(__file__).with_name("cli.py")  # pcp-memory's ranks run it and come back here (--layouts)
MIB = 2 ** 20
FP32 = 4


def layouts(args):
    """The parsed --layouts; a parser error when they need different numbers of ranks."""
    parsed = [Layout.parse(name) for name in args.layouts]
    if len({layout.devices for layout in parsed}) != 1:
        raise SystemExit(f"--layouts {args.layouts}: every layout must use the same number of ranks, they use "
                         f"{[layout.devices for layout in parsed]}")
    return parsed


def model_shape(args):
    return ModelShape(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                      vocab=args.vocab, intermediate=args.intermediate,
                      tied_embeddings=True)  # PaddleFormers LlamaConfig's default


# ---- the rank side ----------------------------------------------------------------

def measure(args, layout, seq):
    """This rank's {part: bytes} for one step of `layout` at global length `seq`: `micro` sequences per
    data-parallel replica (one per pipeline micro-batch)."""
    import gc

    import paddle
    import paddle.distributed as dist

    import paddle_cp as pcp
    from paddle_cp.tools.allocator import allocated
    from paddle_cp.tools.memory.step import build_llama, step_parts
    from paddle_cp.tools.plan.config import model_config, parallelize_config

    gc.collect()
    start = allocated()
    paddle.seed(0)
    model = build_llama(args, **model_config(layout))
    opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())
    config = parallelize_config(layout)
    mesh, config = pcp.load_config(config, world_size=dist.get_world_size())
    model, opt = pcp.parallelize(model, opt, mesh, config)
    params = allocated() - start
    ids = paddle.randint(0, args.vocab, [layout.dp * layout.micro, seq + 1])
    inputs, labels = ids[:, :-1], ids[:, 1:]
    if layout.dp > 1:
        inputs, labels = pcp.shard_batch((inputs, labels), mesh=mesh)
    parts = step_parts(model, opt, {"input_ids": inputs, "labels": labels}, start, params)
    stores = [plan.store for section in config.values() if isinstance(section, dict)
              for plans in (section.get("parallelize_plan") or {}).values()
              for plan in (plans if isinstance(plans, list) else [plans]) if isinstance(plan, pcp.OffloadRecomputeInputs)]
    host_optimizer = getattr(opt, "host_optimizer", None)
    held = host_optimizer.host_bytes() if host_optimizer is not None else 0
    return {**parts, "host": max((store.host_peak for store in stores), default=0) + held}


def run_ranks(args):
    import paddle.distributed as dist

    from paddle_cp.tools.launcher import progress
    from paddle_cp.tools.ranks import max_over_ranks, start_cpu_ranks

    start_cpu_ranks()
    rows = []
    for name, layout in zip(args.layouts, layouts(args)):
        for seq in args.seq:
            progress(f"layout {name}: seq {seq}")
            parts = measure(args, layout, seq)
            largest = max_over_ranks([-1 if parts[p] is None else parts[p] for p in PARTS])
            rows.append({"layout": name, "seq": seq, **{p: None if v < 0 else int(v) for p, v in zip(PARTS, largest)}})
    return rows if dist.get_rank() == 0 else None


# ---- the launcher side ------------------------------------------------------------

def with_estimates(args, rows):
    """Each measured row with the planner's fp32 estimate of every part and estimate / measured."""
    model = model_shape(args)
    for row in rows:
        layout = Layout.parse(row["layout"])
        estimate = measured_parts(memory(model, layout, row["seq"], layout.micro, FP32))
        row["estimate"] = estimate
        row["ratio"] = {p: estimate[p] / row[p] for p in PARTS if row[p]}
    return rows


def collect(args, argv):
    from paddle_cp.tools.launcher import launch

    rows = launch(argparse.Namespace(nproc=layouts(args)[0].devices), argv, script=MEMORY_SCRIPT)
    return {"config": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")},
            "rows": with_estimates(args, rows)}


def table(result):
    head = f"{'layout':28} {'seq':>6}" + "".join(f" {p + ' MiB (est)':>21}" for p in PARTS)
    lines = []
    for row in result["rows"]:
        cells = "".join(f" {'-':>21}" if row[p] is None else
                        f" {row[p] / MIB:>9.2f} ({row['estimate'][p] / MIB:>8.2f})" for p in PARTS)
        lines.append(f"{row['layout']:28} {row['seq']:>6}{cells}")
    return ruled_table(head, lines)
