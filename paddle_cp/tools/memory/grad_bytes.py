"""Gradient-reduction bytes per step, with and without fp32 master gradients, from paddle_cp's own bucket plan.

    python -m paddle_cp.tools.memory.grad_bytes --config llama3-8b.json --ranks 8

A benchmark on paper (no devices, no collectives): the model is built from its config.json under
`paddle.LazyGuard` (shapes only, nothing allocated) as PaddleFormers builds it, every parameter trained and
replicated over `--ranks` data-parallel ranks (one replica group; sharding over all of them). Its gradients are
cut into buckets as `parallelize` cuts a model without an expert plan (data_parallel/buckets.cut_runs, `--bucket-mb`
MiB of gradient in the reverse of the model's order; plan_buckets also puts the parameters of fetch units that run
by the data, a rank's experts, in buckets of their own after the others: no plan here places experts, so there
are none), each bucket's bytes in the gradients' dtype: 4 an element with master
gradients (bf16 O2 with PaddleFormers' amp_master_grad, `decorate(master_grad=True)`), 2 without (bf16 O2 as
Paddle leaves it), and each bucket's collective counted as paddle_cp's collectives count what one rank sends:

- levels 0-1: one all-reduce per bucket, 2 (n-1)/n of its bytes;
- levels 2-3: one reduce-scatter per bucket onto the parameters' owners (sharding.owners: largest first onto
  the least-loaded rank), on NCCL padded to the largest owner's chunk where that moves no more bytes
  (collectives.pads_uneven_chunks: (n-1) x the largest chunk), else one reduce per owner (the chunks this rank
  does not own); the busiest rank's and the mean.

The owners' new values (levels 1-3: broadcast or fetched in the parameters' dtype) are the same either way and
not counted. Gradient accumulation reduces once per step (the last backward), so micro-batches change nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
from pathlib import Path

from paddle_cp.comm.collectives import pads_uneven_chunks
from paddle_cp.data_parallel.buckets import DEFAULT_BUCKET_MB, cut_runs
from paddle_cp.data_parallel.sharding import owners
from paddle_cp.tools.text import ruled_table

MASTER_GRAD_BYTES, LOW_PRECISION_BYTES = 4, 2


def lazy_parameters(config_path):
    """The trained parameters of PaddleFormers' causal LM for the config.json at `config_path`, in the model's
    order, shapes only."""
    import paddle
    from paddle_cp.integrations import zoo

    models = zoo.transformers()

    architecture = (json.loads(Path(config_path).read_text()).get("architectures") or [None])[0]
    if not hasattr(models, str(architecture)):
        raise ValueError(f"{config_path}: its `architectures` names {architecture!r}, not a PaddleFormers model class: "
                         "give the config.json a PaddleFormers causal LM (e.g. \"architectures\": [\"LlamaForCausalLM\"])")
    with tempfile.TemporaryDirectory() as folder:  # PaddleFormers reads a config from a model folder
        shutil.copy(config_path, Path(folder) / "config.json")
        model_config = models.AutoConfig.from_pretrained(folder)
    with paddle.LazyGuard():
        model = getattr(models, architecture)(model_config)
    return [p for p in model.parameters() if not p.stop_gradient]


def _elements(param):
    return math.prod(param.shape)


def reduction_bytes(params, ranks, level, grad_bytes, bucket_mb=DEFAULT_BUCKET_MB):
    """{"buckets", "max", "mean"}: collectives per step and the bytes one rank sends reducing the gradients of
    `params` over `ranks` at sharding `level`, `grad_bytes` an element (the busiest rank's and the mean)."""
    buckets = cut_runs(params[::-1], lambda p: _elements(p) * grad_bytes, bucket_mb)  # backward's order
    if level < 2:
        sent = sum(sum(map(_elements, bucket)) * grad_bytes * 2 * (ranks - 1) // ranks for bucket in buckets)
        return {"buckets": len(buckets), "max": sent, "mean": sent}
    owner = dict(zip(map(id, params), owners(params, ranks)))
    per_rank = [0] * ranks
    for bucket in buckets:
        sizes = [0] * ranks
        for param in bucket:
            sizes[owner[id(param)]] += _elements(param)
        padded = pads_uneven_chunks(sizes)  # one reduce-scatter padded to the largest chunk, else a reduce per owner
        for me in range(ranks):
            if padded:
                per_rank[me] += (ranks - 1) * max(sizes) * grad_bytes
            else:
                per_rank[me] += sum(size for j, size in enumerate(sizes) if j != me) * grad_bytes
    return {"buckets": len(buckets), "max": max(per_rank), "mean": sum(per_rank) / ranks}


def report(params, ranks, bucket_mb=DEFAULT_BUCKET_MB):
    """{level: {"master_grad": reduction_bytes, "bf16": reduction_bytes}} for sharding levels 0-3."""
    return {level: {"master_grad": reduction_bytes(params, ranks, level, MASTER_GRAD_BYTES, bucket_mb),
                    "bf16": reduction_bytes(params, ranks, level, LOW_PRECISION_BYTES, bucket_mb)}
            for level in range(4)}


def table(result, elements):
    head = (f"{'level':>5} {'buckets (fp32 / bf16)':>22} {'GB sent per rank, fp32 master grads':>36} "
            f"{'bf16 grads':>11} {'ratio':>6}")
    rows = []
    for level, by in result.items():
        master, low = by["master_grad"], by["bf16"]
        rows.append(f"{level:>5} {master['buckets']:>10} / {low['buckets']:<9} {master['max'] / 1e9:>36.2f} "
                    f"{low['max'] / 1e9:>11.2f} {master['max'] / low['max']:>6.2f}")
    return ruled_table(head, rows) + f"\n{elements / 1e9:.2f}B trained parameters"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="PaddleFormers / Hugging Face config.json")
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks the gradients are reduced over")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB, help="dp_config bucket_size_mb")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.ranks < 2 or not args.bucket_mb > 0:
        parser.error("--ranks must be at least 2 and --bucket-mb positive")
    params = lazy_parameters(args.config)
    result = report(params, args.ranks, args.bucket_mb)
    print(table(result, sum(map(_elements, params))))
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "bucket_mb": args.bucket_mb, "levels": result},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
