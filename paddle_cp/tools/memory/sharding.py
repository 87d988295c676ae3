"""`pcp-memory --sharding`: what each sharding level leaves a rank on a context-parallel mesh.

    pcp-memory --sharding --json sharding.json
    pcp-memory --sharding --meshes sep4 --levels 3 --seq 1024 --bucket-mb 0.5

One launch of 4 CPU ranks trains a PaddleFormers Llama (ring attention over `sep`, each dp
rank its own samples) for two steps per case: each mesh at sharding level 0 and at each of
--levels, sharded over every rank holding a replica (dp x sep, the default) and over dp
alone (`sharding_mesh_dim="dp"`, the only choice before). Per case and rank, for the
second step (io_phases.py): the bytes of the parameters (and buffers) the rank holds
and of the AdamW state it keeps, each against level 0 (the whole model and one card's
state), the largest parameter (a rank should hold a quarter plus at most one of them), the
allocator's peak, the most gradient bytes it held at once (data_parallel/buckets.py counts
them: buckets of --bucket-mb are reduced as backward fills them, so level 2 holds its share
plus about a bucket, levels 0-1 all of them), and the bytes the rank sent, by purpose
(gradient reductions, parameter broadcasts and fetches, attention). The table shows each case's largest rank; the JSON
has every rank.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from paddle_cp.tools.launcher import launch, progress
from paddle_cp.tools.ranks import gather, start_cpu_ranks
from paddle_cp.tools.memory.io_phases import MIB
from paddle_cp.tools.text import ruled_table, show

MESHES = {"sep4": [("sep", 4)], "dp2xsep2": [("dp", 2), ("sep", 2)]}
SHARDED_OVER = {"dp x sep": None, "dp": "dp"}  # the table's name -> dp_config's sharding_mesh_dim
PURPOSES = {"gradients": "grads", "parameters": "params", "attention": "attention", "other": "other"}  # -> column
FIELDS = ("params", "adam", "peak", "grad_peak", "sent", *PURPOSES)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sharding", action="store_true", required=True)
    parser.add_argument("--meshes", nargs="+", choices=list(MESHES), default=list(MESHES))
    parser.add_argument("--levels", type=int, nargs="+", choices=[1, 2, 3], default=[1, 2, 3])
    parser.add_argument("--seq", type=int, default=256, help="global tokens per sample")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=344)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--bucket-mb", type=float, default=1.0,
                        help="dp_config bucket_size_mb (the default model's layer is 0.7 MiB)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--result-file", help=argparse.SUPPRESS)  # launcher <-> rank 0
    args = parser.parse_args(argv)
    if args.seq < 8:
        parser.error("--seq must be at least 8 (2 x the 4 context-parallel ranks)")
    return args


def cases(args):
    """(mesh, sharded over, level) in run order: level 0 first on each mesh (what the others are measured against)."""
    return [(mesh, over, level) for mesh in args.meshes
            for over, level in [("-", 0)] + [(o, lv) for lv in args.levels for o in SHARDED_OVER]]


def purpose(tag):
    if tag.startswith("grad"):
        return "gradients"
    if tag.startswith("param"):
        return "parameters"
    return "attention" if tag in ("ring", "ulysses", "ulysses_mask", "seq_lengths") else "other"


# ---- the rank side ----------------------------------------------------------------

def _build(args):
    import paddle
    from paddle_cp.integrations import zoo

    pf = zoo.transformers()
    paddle.seed(0)
    model = pf.LlamaForCausalLM(pf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                         num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False))
    return model, paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())


def measure_case(args, mesh_name, over, level):
    """({field: this rank's bytes} for the second training step of one case, the largest parameter's bytes)."""
    import numpy as np
    import paddle
    import paddle.distributed as dist

    import paddle_cp as pcp
    from paddle_cp.comm import counters
    from paddle_cp.tools.memory.io_phases import measure, share_bytes

    dims = MESHES[mesh_name]
    mesh = dist.ProcessMesh(np.arange(4).reshape([n for _, n in dims]).tolist(), dim_names=[d for d, _ in dims])
    model, optimizer = _build(args)
    prepare = pcp.PrepareContextParallel("p2p")
    config = {"cp_config": {"parallelize_plan": {"model": prepare,
                                                 "model.layers.*.self_attn": pcp.ContextParallel("p2p")}},
              "dp_config": {"sharding_level": level, "sharding_mesh_dim": SHARDED_OVER.get(over),
                            "bucket_size_mb": args.bucket_mb}}
    model, optimizer = pcp.parallelize(model, optimizer, mesh, config)
    ids = paddle.randint(0, args.vocab, [2, args.seq + 1])  # the same on every rank (seeded in _build)
    inputs, labels = pcp.shard_batch((ids[:, :-1], ids[:, 1:]), mesh=mesh)
    labels = pcp.shard_sequence(labels, backend=prepare, mesh=mesh)

    def step():
        model(input_ids=inputs, labels=labels)[0].backward()
        optimizer.step()
        optimizer.clear_grad(set_to_zero=False)

    step()  # creates AdamW's state; the buckets learn when backward writes each gradient
    counters.reset()
    optimizer.gradient_buckets.grad_bytes.reset_peak()
    row = measure("step", step, model, optimizer)
    sent = {p: 0 for p in PURPOSES}
    for tag, nbytes in counters.bytes_sent().items():
        sent[purpose(tag)] += nbytes
    params = share_bytes(model)
    return {"params": params, "adam": row["share"] - params, "peak": row["peak"],
            "grad_peak": optimizer.gradient_buckets.grad_bytes.peak, "sent": sum(sent.values()), **sent}, \
        row["largest_parameter"]


def run_ranks(args):
    import paddle.distributed as dist

    start_cpu_ranks()
    results = []
    for mesh_name, over, level in cases(args):
        progress(f"{mesh_name} level {level} over {over}")
        mine, largest = measure_case(args, mesh_name, over, level)
        ranks = [dict(zip(FIELDS, (int(v) for v in row))) for row in gather([float(mine[f]) for f in FIELDS])]
        results.append({"mesh": mesh_name, "sharded_over": over, "level": level, "largest_parameter": largest,
                        "ranks": ranks})
    return with_ratios(results) if dist.get_rank() == 0 else None


def with_ratios(results):
    """Each case's largest rank's params and adam against its mesh's level 0 (the whole model, one card's state)."""
    whole = {r["mesh"]: r["ranks"][0] for r in results if r["level"] == 0}
    for r in results:
        most = {f: max(rank[f] for rank in r["ranks"]) for f in FIELDS}
        r["max"] = most
        r["params_ratio"] = most["params"] / whole[r["mesh"]]["params"]
        r["adam_ratio"] = most["adam"] / whole[r["mesh"]]["adam"]
    return results


# ---- the launcher side ------------------------------------------------------------

def table(results):
    head = (f"{'mesh':9} {'sharded over':12} {'level':>5} {'params MiB':>10} {'of model':>8} {'adam MiB':>9} "
            f"{'of 1 card':>9} {'peak MiB':>9} {'grads MiB':>9} {'sent MiB':>9}" + "".join(f" {c + ' MiB':>13}" for c in PURPOSES.values()))
    rows = [f"{r['mesh']:9} {r['sharded_over']:12} {r['level']:>5} {r['max']['params'] / MIB:>10.2f} "
            f"{r['params_ratio']:>8.3f} {r['max']['adam'] / MIB:>9.2f} {r['adam_ratio']:>9.3f} "
            f"{r['max']['peak'] / MIB:>9.2f} {r['max']['grad_peak'] / MIB:>9.2f} {r['max']['sent'] / MIB:>9.2f}"
            + "".join(f" {r['max'][p] / MIB:>13.2f}" for p in PURPOSES) for r in results]
    largest = max(r["largest_parameter"] for r in results)
    rows.append(f"each case's largest rank; grads: the most gradient bytes it held at once; sent: by it in the second "
                f"step; the largest parameter: {largest / MIB:.2f} MiB")
    return ruled_table(head, rows)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "PADDLE_TRAINER_ID" in os.environ:  # a rank
        result = run_ranks(args)
        if result is not None:
            Path(args.result_file).write_text(json.dumps(result))
        return
    results = launch(argparse.Namespace(nproc=4), argv, script=__file__)
    config = {k: v for k, v in vars(args).items() if k not in ("sharding", "json", "result_file")}
    show(table(results), {"config": config, "cases": results}, args.json)


if __name__ == "__main__":
    main()
