"""pcp-bench --mixer gated_deltanet: a Gated DeltaNet layer under context parallelism against one process.

    pcp-bench --mixer gated_deltanet --nproc 2 4 --seq 2048 --backend p2p all2all --json out.json

The layer is shaped like Qwen3-Next's `linear_attn` (projections, a causal depthwise Conv1D over the
sequence, PaddleFormers' `paddle_chunk_gated_delta_rule`, an output projection) and runs under
`ContextParallel` as a model's would (its conv and rule intercepted: attention/mixers/gated_delta.py).
One launch per --nproc value; per case:

- efficiency = T_single / (N x T_rank): T_single the layer's forward+backward on the whole sequence in
  one process on one thread, timed before the launches; T_rank the slowest rank's median (one thread
  per rank; communication included).
- bytes_per_rank: bytes this rank sent in one forward+backward (paddle_cp.bytes_sent; the 72 bytes of
  PrepareContextParallel's inputs check aside), split by tag:
  `state_passing` (the runs' [A | B] summaries: all-gather forward, reduce-scatter backward),
  `ulysses` (all-to-alls), `sequence_halo` (the conv's edge tokens).
- bytes_min, the algorithm's minimum: p2p, per run of this rank a summary [h, dk, dk + dv] gathered by
  the N-1 others and its gradient back, 2 (N-1) x runs x b h dk (dk + dv) x 4 bytes, independent of the
  length; all2all, the all-to-alls of q, k, v, g, beta and the output, forward and backward,
  2 (N-1)/N x their local bytes; both plus the conv's halo from one neighbour per run, forward and
  backward, 2 x runs x (k - 1) x b x channels x 4. bytes_ratio = bytes_per_rank / bytes_min.

The rank count may exceed the cores: ranks then share cores and efficiency cannot reach 1 (the JSON
records `oversubscribed`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by the launch: import the package from its root
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from paddle_cp.integrations import zoo  # noqa: E402
from paddle_cp.tools.launcher import THREAD_VARS, launch, progress  # noqa: E402
from paddle_cp.tools.ranks import gather, median_time, seeded_normal, sep_mesh, start_cpu_ranks  # noqa: E402

TABLE = ("efficiency", "bytes_per_rank", "bytes_min", "bytes_ratio")


def parse_args(argv=None):
    from paddle_cp.tools.units import tokens  # here: the ranks run this file as a script

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="context-parallel ranks, one launch each")
    parser.add_argument("--seq", type=tokens, nargs="+", default=[2048], help="sequence lengths (4K = 4096)")
    parser.add_argument("--backend", nargs="+", choices=["p2p", "all2all"], default=["p2p", "all2all"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8, help="v heads (q/k repeated to them)")
    parser.add_argument("--head-dim", type=int, default=64, help="dk = dv")
    parser.add_argument("--kernel", type=int, default=4, help="the causal conv's kernel")
    parser.add_argument("--iters", type=int, default=3, help="timed repetitions (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--result-file", help=argparse.SUPPRESS)  # launcher <-> rank 0
    args = parser.parse_args(argv)
    _check(parser, args)
    return args


def _check(parser, args):
    """Refuse shapes the layouts cannot split, before any rank starts."""
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout
    from paddle_cp.attention.algorithms.ulysses import head_split

    for n in args.nproc:
        for backend in args.backend:
            try:
                for seq in args.seq:
                    SequenceLayout(backend, n).check_length(seq)
                if backend == "all2all":
                    head_split(args.heads, args.heads, n)
            except ValueError as error:
                parser.error(f"--backend {backend} on {n} ranks: {error}")


def gated_delta_layer(args):
    """A layer shaped like Qwen3-Next's Gated DeltaNet, built from the global random state."""
    import paddle
    import paddle.nn.functional as F

    heads, dim, kernel = args.heads, args.head_dim, args.kernel
    channels = 3 * heads * dim
    rule = zoo.gated_delta_rule()

    class GatedDeltaLayer(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.in_proj = paddle.nn.Linear(args.hidden, channels + 2 * heads, bias_attr=False)
            self.conv1d = paddle.nn.Conv1D(channels, channels, kernel, groups=channels, padding=kernel - 1,
                                           bias_attr=False)
            self.out_proj = paddle.nn.Linear(heads * dim, args.hidden, bias_attr=False)
            self.chunk_gated_delta_rule = rule

        def forward(self, hidden_states):
            b, s, _ = hidden_states.shape
            mixed, a, beta = paddle.split(self.in_proj(hidden_states), [channels, heads, heads], axis=-1)
            # [b, s, C] -> [b, C, s] -> causal conv -> [b, s, C]
            mixed = F.silu(self.conv1d(mixed.transpose([0, 2, 1]))[:, :, :s]).transpose([0, 2, 1])
            q, k, v = (x.reshape([b, s, heads, dim]) for x in paddle.split(mixed, 3, axis=-1))
            out, _ = self.chunk_gated_delta_rule(q, k, v, g=-F.softplus(a), beta=F.sigmoid(beta), initial_state=None,
                                                 output_final_state=False, use_qk_l2norm_in_kernel=True)
            return self.out_proj(out.reshape([b, s, heads * dim]))

    class Holder(paddle.nn.Layer):  # the top layer PrepareContextParallel splits
        def __init__(self):
            super().__init__()
            self.gdn = GatedDeltaLayer()

        def forward(self, hidden_states):
            return self.gdn(hidden_states)

    return Holder()


def _inputs(args, seq):
    """The layer's input and its output's gradient, seeded by the length."""
    return seeded_normal(seq, [args.batch, seq, args.hidden], [args.batch, seq, args.hidden])


def _fwd_bwd(paddle, layer, x, dout):
    x = x.detach()
    x.stop_gradient = False
    return paddle.grad([layer(hidden_states=x)], [x, *layer.parameters()], [dout])


def measure_single(args):
    import paddle

    paddle.set_device("cpu")
    paddle.seed(0)
    layer = gated_delta_layer(args)
    times = {}
    for seq in args.seq:
        progress(f"seq {seq}: one process")
        x, dout = _inputs(args, seq)
        times[seq] = median_time(lambda: _fwd_bwd(paddle, layer, x, dout), args.iters, args.warmup)
    return times


def run_ranks(args):
    import paddle
    import paddle.distributed as dist

    import paddle_cp as pcp
    from paddle_cp.plans import same_batch

    world = start_cpu_ranks()
    mesh = sep_mesh(world)
    runs = []
    for backend in args.backend:
        paddle.seed(0)
        layer = gated_delta_layer(args)
        prepare = pcp.PrepareContextParallel(backend)
        plan = {"": prepare, "gdn": pcp.ContextParallel(backend)}
        pcp.parallelize(layer, None, mesh, {"cp_config": {"parallelize_plan": plan}})
        for seq in args.seq:
            progress(f"seq {seq}: {backend} on {world} ranks")
            x, dout = _inputs(args, seq)
            dout = pcp.shard_sequence(dout, backend=prepare, mesh=mesh)
            pcp.reset_counters()
            _fwd_bwd(paddle, layer, x, dout)
            sent = pcp.bytes_sent()
            sent.pop(same_batch.TAG, None)  # PrepareContextParallel's inputs check, not the layer's mixing
            seconds = median_time(lambda: _fwd_bwd(paddle, layer, x, dout), args.iters, args.warmup,
                                         dist.barrier)
            tags = ("state_passing", "ulysses", "sequence_halo")
            measured = [seconds, sum(sent.values()), *(sent.get(tag, 0) for tag in tags)]
            runs.append([seq, backend, gather(measured)])
    return {"runs": runs} if dist.get_rank() == 0 else None


# ---- figures ----------------------------------------------------------------------

def bytes_min(args, backend, world, seq):
    """The algorithm's minimum bytes per rank for one forward+backward (the slowest rank's)."""
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout, runs

    layout = SequenceLayout(backend, world)
    b, h, d = args.batch, args.heads, args.head_dim
    channels = 3 * h * d
    most_runs = max(len(runs(layout.positions(seq, r))) for r in range(world))
    halo = 2 * most_runs * (args.kernel - 1) * b * channels * 4
    if backend == "p2p":
        return 2 * (world - 1) * most_runs * b * h * d * (2 * d) * 4 + halo
    local = max(layout.lengths(seq))
    per_token = b * h * (3 * d + 2 + d) * 4  # q, k, v, g, beta in, the output back
    return 2 * (world - 1) / world * local * per_token + halo


def summarise(args, world, seq, backend, t_single, per_rank):
    t_rank = max(r[0] for r in per_rank)
    sent = int(max(r[1] for r in per_rank))
    minimum = bytes_min(args, backend, world, seq)
    return {
        "backend": backend, "nproc": world, "seq": seq, "t_single": t_single, "t_rank": t_rank,
        "efficiency": t_single / (world * t_rank),
        "bytes_per_rank": sent, "bytes_min": minimum, "bytes_ratio": sent / minimum,
        "bytes_by_tag": {tag: int(max(r[i] for r in per_rank))
                         for i, tag in enumerate(("state_passing", "ulysses", "sequence_halo"), start=2)},
        "oversubscribed": world > (os.cpu_count() or 1),
    }


def table(result):
    from paddle_cp.tools.text import ruled_table

    head = f"{'backend':8} {'seq':>6} {'N':>2} {'T_single':>9} {'T_rank':>9} {'efficiency':>10} {'bytes/rank':>12} " \
           f"{'bytes_min':>12} {'bytes_ratio':>11}"
    return ruled_table(head, [
        f"{c['backend']:8} {c['seq']:>6} {c['nproc']:>2} {c['t_single']:>8.3f}s {c['t_rank']:>8.3f}s "
        f"{c['efficiency']:>10.3f} {c['bytes_per_rank']:>12,} {int(c['bytes_min']):>12,} {c['bytes_ratio']:>11.3f}"
        for c in result["cases"]])


def main(argv=None):
    from paddle_cp.tools.text import show

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "PADDLE_TRAINER_ID" in os.environ:  # a rank of one of the launches below
        measured = run_ranks(args)
        if measured is not None:
            Path(args.result_file).write_text(json.dumps(measured))
        return
    os.environ.update({name: "1" for name in THREAD_VARS})  # one thread, like each rank
    single = measure_single(args)
    cases = []
    for world in args.nproc:  # the ranks read their world size from the launch
        measured = launch(argparse.Namespace(nproc=world), argv, script=__file__)
        cases += [summarise(args, world, seq, backend, single[seq], per_rank)
                  for seq, backend, per_rank in measured["runs"]]
    result = {"config": {k: getattr(args, k) for k in ("batch", "hidden", "heads", "head_dim", "kernel", "iters")},
              "cases": cases}
    result["config"].update(dtype="float32", threads_per_rank=1, cpu_count=os.cpu_count(), mixer="gated_deltanet")
    show(table(result), result, args.json)


if __name__ == "__main__":
    main()
