"""Rank data x context (ring / Ulysses / hybrid) x tensor parallel layouts for a model and a cluster.

    pcp-plan --config config.json --seq 131072 --devices 16 --memory-gb 80

Prints a table of candidates (best first) and the best layout paddle_cp can run as
a YAML config for `paddle_cp.load_config`; `--json` writes everything. The cost
model is paddle_cp/tools/planner.py: a model of GPU clusters, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from paddle_cp.tools import planner
from paddle_cp.tools.text import ruled_table

GB = 1e9
SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "vocab", "intermediate")


class _Dumper(yaml.SafeDumper):
    """Block style, except lists of scalars (mesh shape, dim names) on one line."""


_Dumper.add_representer(list, lambda dumper, value: dumper.represent_sequence(
    "tag:yaml.org,2002:seq", value, flow_style=all(isinstance(v, (int, str)) for v in value)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="PaddleFormers / Hugging Face config.json (instead of the shape flags)")
    for flag in SHAPE_FLAGS:
        parser.add_argument("--" + flag.replace("_", "-"), type=int)
    parser.add_argument("--seq", type=int, required=True, help="sequence length")
    parser.add_argument("--batch", type=int, default=1, help="sequences per data-parallel replica per step")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--memory-gb", type=float, default=80.0, help="memory per device")
    parser.add_argument("--tflops", type=float, default=400.0, help="achievable TFLOP/s per device")
    parser.add_argument("--intra-gbps", type=float, default=300.0, help="GB/s per device within a node")
    parser.add_argument("--inter-gbps", type=float, default=25.0, help="GB/s per device across nodes")
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--dtype-bytes", type=int, default=2, help="2 for bf16/fp16 training, 4 for fp32")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--model-prefix", default="model", help="name of the decoder in the model (for plan keys)")
    parser.add_argument("--top", type=int, default=10, help="rows of the table")
    parser.add_argument("--json", help="write all estimates and the winning config here")
    args = parser.parse_args(argv)
    if not args.config and any(getattr(args, f) is None for f in SHAPE_FLAGS if f != "kv_heads"):
        parser.error("give --config config.json, or --layers --hidden --heads --vocab --intermediate [--kv-heads]")
    return args


def model_shape(args):
    if args.config:
        return planner.ModelShape.from_config(json.loads(Path(args.config).read_text()))
    values = {f: getattr(args, f) for f in SHAPE_FLAGS}
    values["kv_heads"] = values["kv_heads"] or values["heads"]
    return planner.ModelShape(**values)


def table(estimates, top):
    head = f"{'layout':24} {'backend':8} {'mem GB':>8} {'fits':>5} {'step s':>8} {'tok/s':>10}  time split (s)"
    rows = []
    for e in estimates[:top]:
        split = " ".join(f"{k}={v:.3g}" for k, v in e["time"].items() if v)
        rows.append(f"{e['name']:24} {e['backend']:8} {e['memory_total'] / GB:>8.1f} {'yes' if e['fits'] else 'no':>5}"
                    f" {e['step_time']:>8.3f} {e['tokens_per_second']:>10.0f}  {split}")
    return ruled_table(head, rows)


def main(argv=None):
    args = parse_args(argv)
    model = model_shape(args)
    cluster = planner.Cluster(args.devices, args.memory_gb * GB, args.tflops * 1e12, args.intra_gbps * GB,
                              args.inter_gbps * GB, args.devices_per_node)
    estimates = planner.rank_layouts(model, cluster, args.seq, args.batch, args.dtype_bytes, not args.no_causal)
    if not estimates:
        sys.exit(f"no layout of {args.devices} devices suits {model} at sequence {args.seq}")
    print(table(estimates, args.top))
    best = next((e for e in estimates if e["fits"]), None)
    config = None
    if best is None:
        print("\nno layout fits in memory: add devices, shorten the sequence or lower the batch")
    else:
        config = planner.parallelize_config(planner.Layout(**best["layout"]), args.model_prefix)
        print(f"\n# best layout: {best['name']} ({best['backend']}), "
              f"{best['tokens_per_second']:.0f} tokens/s, {best['memory_total'] / GB:.1f} GB per device")
        print(yaml.dump(config, Dumper=_Dumper, sort_keys=False), end="")
    if args.json:
        result = {"model": vars(model), "cluster": vars(cluster), "seq": args.seq, "estimates": estimates,
                  "best": best, "config": config}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
