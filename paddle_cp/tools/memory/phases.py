"""`pcp-memory --phases`: memory and I/O of the startup and I/O phases, per rank.

    pcp-memory --phases --layout dp2xmp2_l3 --json phases.json
    pcp-memory --phases --layout pp2xsep2 --family phi3 --init eager

One launch of 4 CPU ranks runs, on a PaddleFormers model (weights first written by
`save_pretrained` in the launching process, like a downloaded checkpoint):
initialize (build + parallelize; `--init lazy`: build under paddle.LazyGuard(), parallelize,
then `p.initialize()` for every parameter), load_pretrained, one training step (so the
optimizer has state), export (export_pretrained), save and load (save_checkpoint,
load_checkpoint with the optimizer). Each phase reports per rank (io_phases.py) its
peak from Paddle's allocator statistics (the model's tensors and what the phase adds), the
share (what the rank holds after it), the bound share + 2 x the largest parameter, and the
bytes read and written: a table, and JSON with --json.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from paddle_cp.tools.launcher import launch
from paddle_cp.tools.ranks import start_cpu_ranks, write_every_ranks_rows
from paddle_cp.tools.memory.io_phases import MIB, bound
from paddle_cp.tools.text import ruled_table, show

LAYOUTS = ("dp2xmp2_l3", "pp2xsep2")
COLUMNS = ("peak", "share", "bound", "read", "written")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", action="store_true", required=True)
    parser.add_argument("--layout", choices=LAYOUTS, default="dp2xmp2_l3")
    parser.add_argument("--family", choices=["llama", "phi3"], default="llama")
    parser.add_argument("--init", choices=["eager", "lazy"], default="eager",
                        help="lazy: build under paddle.LazyGuard() (needs paddle_cp's lazy initialization)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--weights", help=argparse.SUPPRESS)  # launcher -> ranks: the save_pretrained directory
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def config(args):
    from paddle_cp.integrations import zoo

    pf = zoo.transformers()

    sizes = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                 num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, fuse_rms_norm=False)
    cls, config_cls = {"llama": (pf.LlamaForCausalLM, pf.LlamaConfig), "phi3": (pf.Phi3ForCausalLM, pf.Phi3Config)}[
        args.family]
    return cls, config_cls(**sizes)


def parallel_config(layout, family):
    """(mesh, parallelize config) of a layout on 4 ranks."""
    import paddle.distributed as dist

    import paddle_cp as pcp

    if layout == "dp2xmp2_l3":
        attention = ["qkv_proj"] if family == "phi3" else ["q_proj", "k_proj", "v_proj"]
        mlp = ["gate_up_proj"] if family == "phi3" else ["gate_proj", "up_proj"]
        plan = {"model.embed_tokens": pcp.ColWiseParallel(), "lm_head": pcp.ColWiseParallel(),
                "model.layers.*.self_attn.o_proj": pcp.RowWiseParallel(),
                "model.layers.*.mlp.down_proj": pcp.RowWiseParallel(),
                **{f"model.layers.*.self_attn.{name}": pcp.ColWiseParallel() for name in attention},
                **{f"model.layers.*.mlp.{name}": pcp.ColWiseParallel() for name in mlp}}
        return (dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]),
                {"mp_config": {"parallelize_plan": plan}, "dp_config": {"sharding_level": 3}})
    return (dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "sep"]),
            {"cp_config": {"parallelize_plan": {"": pcp.PrepareContextParallel("p2p"),
                                                "model.layers.*.self_attn": pcp.ContextParallel("p2p")}},
             "pp_config": {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "accumulate_steps": 2}})


# ---- the rank side ----------------------------------------------------------------

def _initialize(args, cls, model_config):
    """Build and parallelize (lazily: then initialize each parameter, as the script's loop does)."""
    import paddle

    import paddle_cp as pcp

    paddle.seed(0)
    if args.init == "lazy":
        with paddle.LazyGuard():
            model = cls(model_config)
    else:
        model = cls(model_config)
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())
    mesh, parallel = parallel_config(args.layout, args.family)
    model, optimizer = pcp.parallelize(model, optimizer, mesh, parallel)
    if args.init == "lazy":
        for param in model.parameters():
            param.initialize()
    return model, optimizer, mesh


def _step(model, optimizer, mesh, vocab):
    import paddle

    import paddle_cp as pcp

    ids = paddle.randint(0, vocab, [4, 17])
    inputs, labels = ids[:, :-1], ids[:, 1:]
    if "dp" in mesh.dim_names:
        inputs, labels = pcp.shard_batch((inputs, labels), mesh=mesh)
    model(input_ids=inputs, labels=labels)[0].backward()
    optimizer.step()
    optimizer.clear_grad()


def run_rank(args, scratch):
    import paddle.distributed as dist

    import paddle_cp as pcp
    from paddle_cp.tools.memory.io_phases import measure

    start_cpu_ranks()
    cls, model_config = config(args)
    built = {}

    def initialize():
        built["model"], built["optimizer"], built["mesh"] = _initialize(args, cls, model_config)
        return built["model"]

    rows = [measure("initialize", initialize)]
    model, optimizer, mesh = built["model"], built["optimizer"], built["mesh"]
    rows.append(measure("load_pretrained", lambda: pcp.load_pretrained(model, args.weights), model))
    _step(model, optimizer, mesh, args.vocab)
    rows.append(measure("export", lambda: pcp.export_pretrained(model, os.path.join(scratch, "export")), model))
    checkpoint = os.path.join(scratch, "checkpoint")
    rows.append(measure("save", lambda: pcp.save_checkpoint(checkpoint, model, optimizer), model, optimizer))
    rows.append(measure("load", lambda: pcp.load_checkpoint(checkpoint, model, optimizer), model, optimizer))
    return [dict(row, rank=dist.get_rank(), bound=bound(row)) for row in rows]


# ---- the launcher side ------------------------------------------------------------

def table(rows):
    head = f"{'rank':>4} {'phase':16}" + "".join(f" {c + ' MiB':>12}" for c in COLUMNS) + f" {'seconds':>8}"
    lines = [f"{r['rank']:>4} {r['phase']:16}" + "".join(f" {r[c] / MIB:>12.2f}" for c in COLUMNS)
             + f" {r['seconds']:>8.2f}" for r in sorted(rows, key=lambda r: (r["phase"] != "initialize", r["rank"]))]
    return ruled_table(head, lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "PADDLE_TRAINER_ID" in os.environ:  # a rank
        write_every_ranks_rows(args.result_file, run_rank(args, os.path.dirname(args.result_file)))
        return
    with tempfile.TemporaryDirectory(prefix="pcp_memory_phases_") as weights:
        import paddle

        cls, model_config = config(args)
        paddle.seed(1)
        cls(model_config).save_pretrained(weights)  # what a fine-tuning run starts from
        rows = launch(argparse.Namespace(nproc=4), [*argv, "--weights", weights], script=__file__)
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("weights", "result_file", "json")},
              "rows": rows}
    show(table(rows), result, args.json)


if __name__ == "__main__":
    main()
