"""`pcp-memory --experts`: a MoE model's training step per rank with expert parallelism, beside the same model at
sharding level 3 without it (and replicated), in one launch.

    pcp-memory --experts --dims dp=2 sep=2 --json experts.json

One launch of dp x sep CPU ranks trains PaddleFormers' gpt-oss (stacked routed experts; it builds without
GPU modules) with context parallelism over `sep` (ring) under four configs: `ep` (ep_config, expert groups
of --degree ranks), `ep+level3` (also sharding level 3: the experts over the ranks holding the same ones,
the rest over dp x sep), `level3` (sharding level 3 over dp x sep, no expert parallelism) and `replicated`. Each
reports per rank, from Paddle's host allocator statistics and the byte counters: the parameters and
routed experts it holds, AdamW's state after a step, the peak of the second step, and the bytes it sent in
that step by kind (the experts' all-to-alls, parameter fetches, gradient reductions, attention). The
all-to-alls are set against their analytic minimum: every (token, slot) pair whose expert another rank of
its group owns crosses once to the owner and once back, forward and again backward, `4 x pairs x hidden x
4 bytes` (the counts exchanged to size them are reported apart).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from paddle_cp.tools.allocator import allocated, peak, reset_peak
from paddle_cp.tools.launcher import launch, progress
from paddle_cp.tools.ranks import start_cpu_ranks, write_every_ranks_rows
from paddle_cp.tools.text import ruled_table, show

CONFIGS = ("ep", "ep+level3", "level3", "replicated")
MIB = 2 ** 20
KINDS = {  # counter tag prefix -> column
    "ep_dispatch": "all_to_all", "ep_combine": "all_to_all", "ep_counts": "counts", "ep_router": "counts",
    "param_fetch": "param_fetch", "grad": "gradients", "param_broadcast": "gradients",
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", action="store_true", required=True)
    parser.add_argument("--dims", nargs="+", default=["dp=2", "sep=2"], help="mesh dims as name=size (dp, sep)")
    parser.add_argument("--degree", type=int, help="ranks of an expert group (default: all of dp x sep)")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--expert-intermediate", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2, help="global batch (divisible by dp)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.mesh = {name: int(size) for name, size in (dim.split("=") for dim in args.dims)}
    except ValueError:
        parser.error(f"--dims takes name=size pairs, got {args.dims}")
    if set(args.mesh) - {"dp", "sep"} or any(size < 1 for size in args.mesh.values()):
        parser.error(f"--dims: dp and sep only, positive sizes; got {args.dims}")
    folded = math.prod(args.mesh.values())
    args.degree = args.degree or folded
    if folded % args.degree:
        parser.error(f"--degree {args.degree} must divide dp x sep = {folded}")
    if args.batch % args.mesh.get("dp", 1):
        parser.error("--batch must be divisible by dp")
    return args


# ---- the rank side ----------------------------------------------------------------

def _model(args):
    from paddle_cp.integrations import zoo

    pf = zoo.transformers()

    return pf.GptOssForCausalLM(pf.GptOssConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.expert_intermediate,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
        num_local_experts=args.num_experts, num_experts_per_tok=args.top_k, fuse_rms_norm=False, dtype="float32"))


def _config(name, args):
    import paddle_cp as pcp

    config = {"cp_config": {"parallelize_plan": {"": pcp.PrepareContextParallel("p2p"),
                                                 "model.layers.*.self_attn": pcp.ContextParallel("p2p")}}}
    if args.mesh.get("sep", 1) == 1:
        config = {}
    if name.startswith("ep"):
        config["ep_config"] = {"degree": args.degree, "parallelize_plan": {"model.layers.*.mlp": pcp.ExpertParallel()}}
    config["dp_config"] = {"sharding_level": 3 if name.endswith("level3") else 0}
    return config


def _remote_pairs(model, mesh, degree):
    """A forward pre-hook per MoE block counting the (token, slot) pairs whose expert another rank of this
    rank's expert group owns; returns the running count."""
    import numpy as np

    from paddle_cp.experts.layout import ExpertLayout
    from paddle_cp.mesh import fold_groups

    position = fold_groups(mesh, ["dp", "sep"], degree)[0].index  # made by parallelize: no new group
    count = [0]
    for layer in model.model.layers:
        layout = ExpertLayout(layer.mlp.experts.num_experts, degree)
        start, stop = layout.range_of(position)

        def hook(experts, inputs, kwargs, start=start, stop=stop):
            indices = kwargs["router_indices"].numpy()
            count[0] += int(np.sum((indices < start) | (indices >= stop)))

        layer.mlp.experts.register_forward_pre_hook(hook, with_kwargs=True)
    return count


def _kind(tag):
    return next((kind for prefix, kind in KINDS.items() if tag.startswith(prefix)), "attention and other")


def measure(name, args, mesh):
    """This rank's numbers for one config (a fresh model, two steps: the second is measured)."""
    import gc

    import paddle

    import paddle_cp as pcp
    from paddle_cp.tools.memory.io_phases import share_bytes

    gc.collect()
    start = allocated()
    paddle.seed(0)
    model = _model(args)
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())
    model, optimizer = pcp.parallelize(model, optimizer, mesh, _config(name, args))
    held = share_bytes(model)
    experts = sum(math.prod(p.shape) * p.element_size() for n, p in model.named_parameters()
                  if ".mlp.experts." in n and p._is_initialized())
    remote = _remote_pairs(model, mesh, args.degree) if name.startswith("ep") else [0]
    paddle.seed(1)
    ids = paddle.randint(0, args.vocab, [args.batch, args.seq + 1])
    inputs, labels = pcp.shard_batch((ids[:, :-1], ids[:, 1:]), mesh=mesh)

    def step():
        model(input_ids=inputs, labels=labels)[0].backward()
        optimizer.step()
        optimizer.clear_grad(set_to_zero=False)

    step()
    adam = share_bytes(model, optimizer) - share_bytes(model)
    remote[0] = 0
    pcp.reset_counters()
    base = allocated()
    reset_peak()
    step()
    sent = {}
    for tag, nbytes in pcp.bytes_sent().items():
        sent[_kind(tag)] = sent.get(_kind(tag), 0) + nbytes
    row = {"config": name, "held": held, "experts": experts, "adam": adam, "peak": peak() - start,
           "step_extra": peak() - base, "sent": sent, "sent_total": sum(sent.values()),
           "remote_pairs": remote[0]}
    del model, optimizer
    return row


def run_rank(args):
    import numpy as np
    import paddle.distributed as dist

    start_cpu_ranks()
    names = list(args.mesh)
    mesh = dist.ProcessMesh(np.arange(dist.get_world_size()).reshape([args.mesh[n] for n in names]).tolist(),
                            dim_names=names)
    rows = []
    for name in CONFIGS:
        progress(f"{name}")
        rows.append(dict(measure(name, args, mesh), rank=dist.get_rank()))
    return rows


# ---- the launcher side ------------------------------------------------------------

def summary(rows, args):
    """Per config: the largest over ranks of each figure, bytes sent summed over ranks, and the all-to-alls
    against their minimum (summed over ranks)."""
    out = {}
    for name in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        kinds = sorted({k for r in mine for k in r["sent"]})
        out[name] = {**{key: max(r[key] for r in mine) for key in ("held", "experts", "adam", "peak")},
                     "sent_per_rank": max(r["sent_total"] for r in mine),
                     "sent_by_kind": {k: sum(r["sent"].get(k, 0) for r in mine) for k in kinds}}
        if name.startswith("ep"):
            minimum = 4 * sum(r["remote_pairs"] for r in mine) * args.hidden * 4
            moved = out[name]["sent_by_kind"].get("all_to_all", 0)
            out[name]["all_to_all"] = {"moved": moved, "minimum": minimum,
                                       "ratio": moved / minimum if minimum else None}
    return out


def table(result):
    head = (f"{'config':12} {'held MiB':>9} {'experts MiB':>12} {'Adam MiB':>9} {'peak MiB':>9} "
            f"{'sent/rank MiB':>14}  sent over all ranks by kind (MiB)")
    lines = []
    for name, s in result["summary"].items():
        kinds = ", ".join(f"{k} {v / MIB:.2f}" for k, v in s["sent_by_kind"].items())
        lines.append(f"{name:12} {s['held'] / MIB:>9.2f} {s['experts'] / MIB:>12.2f} {s['adam'] / MIB:>9.2f} "
                     f"{s['peak'] / MIB:>9.2f} {s['sent_per_rank'] / MIB:>14.2f}  {kinds}")
    for name in ("ep", "ep+level3"):
        a2a = result["summary"][name]["all_to_all"]
        lines.append(f"{name}: expert all-to-alls {a2a['moved'] / MIB:.3f} MiB moved, analytic minimum "
                     f"{a2a['minimum'] / MIB:.3f} MiB (ratio {a2a['ratio']:.3f})")
    return ruled_table(head, lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "PADDLE_TRAINER_ID" in os.environ:  # a rank
        write_every_ranks_rows(args.result_file, run_rank(args))
        return
    rows = launch(argparse.Namespace(nproc=math.prod(args.mesh.values())), argv, script=__file__)
    config = {k: v for k, v in vars(args).items() if k not in ("result_file", "json", "experts")}
    result = {"config": config, "rows": rows, "summary": summary(rows, args)}
    show(table(result), result, args.json)


if __name__ == "__main__":
    main()
