"""Benchmark pipeline schedules: bubble, stage-to-stage bytes and peak memory per stage.

    pcp-bench-pp --nproc 2 --micro 2 4 8 --schedule FThenB 1F1B VPP --json out.json

Launches `--nproc` CPU ranks (one pipeline stage each) and trains a stack of
`--layers` residual MLP blocks ([b, s, h] -> 4h -> h) under every schedule and
micro-batch count, reporting per case (median over `--steps` timed steps):

- bubble: 1 - (time all ranks spent in F and B actions) / (ranks x step time), from
  the per-action timers of `paddle_cp.pipeline.step_timeline`, the step running
  from the first action of any rank to the last. Next to it `bubble_formula`:
  (p-1)/(m+p-1), divided by v for VPP. Transfers count as bubble; the formula
  assumes they are free and that every forward (and every backward) takes the same time.
- p2p_bytes: activation and gradient bytes each stage sent (`bytes_sent`) and
  `p2p_predicted`: per boundary crossed, m micro-batches of b/m x s x h x 4 bytes each
  way; summed over stages 2(pv-1) x m x (b/m) x s x h x 4. The skeleton messages
  (shapes, a few dozen bytes each, once per batch layout: none in a step after the warm-up) are reported apart as `meta_bytes`.
- peak_mb: Paddle's host allocator peak during a step, per stage (parameters,
  optimizer state, activations in flight).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from paddle_cp.tools.launcher import launch, progress  # absolute: the ranks run this file as a script
from paddle_cp.tools.ranks import start_cpu_ranks
from paddle_cp.tools.text import show

SCHEDULES = ("FThenB", "1F1B", "VPP")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="pipeline stages (CPU processes)")
    parser.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8], help="micro-batches per step (m)")
    parser.add_argument("--schedule", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--vpp", type=int, default=2, help="chunks per rank for VPP")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split into micro-batches)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median), after one warm-up step")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--result-file", help=argparse.SUPPRESS)  # launcher <-> rank 0
    args = parser.parse_args(argv)
    for m in args.micro:
        if args.batch % m:
            parser.error(f"--micro {m} must divide --batch {args.batch}")
    if "VPP" in args.schedule and args.layers % (args.nproc * args.vpp):
        parser.error(f"VPP needs --layers divisible by nproc x vpp = {args.nproc * args.vpp}")
    if args.layers < args.nproc:
        parser.error("--layers must be at least --nproc")
    return args


def bubble_formula(p, m, v=1):
    return (p - 1) / (m + p - 1) / v


def predicted_bytes(stage, p, m, v, micro_bytes):
    """Activation bytes sent forward plus gradient bytes sent back by `stage` in one step."""
    virtual = [c * p + stage for c in range(v)]
    crossings = sum(j < p * v - 1 for j in virtual) + sum(j > 0 for j in virtual)
    return crossings * m * micro_bytes


def measured_bubble(timelines):
    start = min(t[3] for line in timelines for t in line)
    end = max(t[4] for line in timelines for t in line)
    busy = sum(t[4] - t[3] for line in timelines for t in line if t[0] in ("F", "B"))
    return 1 - busy / (len(timelines) * (end - start))


# ---- the rank side ----------------------------------------------------------------

def _model(paddle, args):
    from paddle import nn

    class Block(nn.Layer):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(args.hidden, 4 * args.hidden), nn.Linear(4 * args.hidden, args.hidden)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(x)))

    class Stack(nn.Layer):
        def __init__(self):
            super().__init__()
            self.blocks = nn.LayerList([Block() for _ in range(args.layers)])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    return Stack()


def _case(paddle, dist, pcp, args, schedule, m):
    from paddle_cp.pipeline import step_timeline
    from paddle_cp.tools.allocator import allocated, peak, reset_peak

    paddle.seed(0)
    model = _model(paddle, args)
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())
    v = args.vpp if schedule == "VPP" else 1
    mesh = dist.ProcessMesh(list(range(args.nproc)), dim_names=["pp"])
    model, optimizer = pcp.parallelize(model, optimizer, mesh, {"pp_config": {
        "split_spec": "blocks", "schedule_mode": schedule, "accumulate_steps": m, "vpp_degree": v,
        "loss_fn": lambda out, target: (out - target).pow(2).mean()}})
    x = paddle.randn([args.batch, args.seq, args.hidden])
    y = paddle.randn([args.batch, args.seq, args.hidden])
    bubbles, sent, peaks = [], {}, []
    for step in range(1 + args.steps):
        dist.barrier()
        pcp.reset_counters()
        base = allocated()
        reset_peak()
        model(x, labels=y)[0].backward()
        optimizer.step()
        optimizer.clear_grad()
        step_peak = peak() - base
        timelines = []
        dist.all_gather_object(timelines, step_timeline(model))
        if step > 0:
            bubbles.append(measured_bubble(timelines))
            peaks.append(step_peak)
            sent = pcp.bytes_sent()
    micro_bytes = args.batch // m * args.seq * args.hidden * 4
    stage = dist.get_rank()
    local = [sent.get("pp_activation", 0) + sent.get("pp_gradient", 0), sent.get("pp_meta", 0),
             predicted_bytes(stage, args.nproc, m, v, micro_bytes), max(peaks) / 2 ** 20]
    per_stage = []
    dist.all_gather_object(per_stage, local)
    return {"schedule": schedule, "m": m, "v": v, "bubble": statistics.median(bubbles),
            "bubble_formula": bubble_formula(args.nproc, m, v),
            "p2p_bytes": [s[0] for s in per_stage], "p2p_predicted": [s[2] for s in per_stage],
            "meta_bytes": [s[1] for s in per_stage], "peak_mb": [round(s[3], 2) for s in per_stage],
            "p2p_total_formula": 2 * (args.nproc * v - 1) * m * micro_bytes}


def run_ranks(args):
    import paddle
    import paddle.distributed as dist

    import paddle_cp as pcp

    start_cpu_ranks(args.nproc)
    cases = []
    for schedule in args.schedule:
        for m in args.micro:
            progress(f"{schedule}, m={m} on {args.nproc} stages")
            cases.append(_case(paddle, dist, pcp, args, schedule, m))
    if dist.get_rank() == 0:
        return {"config": {k: v for k, v in vars(args).items() if k not in ("json", "result_file")},
                "oversubscribed": args.nproc > (os.cpu_count() or 1), "cases": cases}
    return None


def table(result):
    lines = [f"{'schedule':8} {'m':>3} {'v':>2} {'bubble':>7} {'formula':>7}  p2p bytes per stage (predicted)  peak MB"]
    for c in result["cases"]:
        lines.append(f"{c['schedule']:8} {c['m']:3d} {c['v']:2d} {c['bubble']:7.3f} {c['bubble_formula']:7.3f}  "
                     f"{c['p2p_bytes']} ({c['p2p_predicted']})  {c['peak_mb']}")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "PADDLE_TRAINER_ID" not in os.environ:
        result = launch(args, argv, script=__file__)
    else:
        result = run_ranks(args)
        if result is None:
            return
        if args.result_file:
            Path(args.result_file).write_text(json.dumps(result))
            return
    show(table(result), result, args.json)


if __name__ == "__main__":
    main()
