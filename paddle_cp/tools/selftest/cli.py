"""pcp-selftest: does context-parallel attention compute, on this machine's devices, what one device does?

    pcp-selftest --nproc 8                      (starts 8 ranks: one per GPU, or CPU ranks on gloo)
    python -m paddle.distributed.launch --nproc_per_node 8 paddle_cp/tools/selftest/cli.py   (inside a launch)

Run it before a long job. On every rank, from one seed, a batch of packed documents (uneven, crossing the
ranks' shares) under causal attention with a sliding window, forward and backward (q, k, v gradients) through
the public API (`pcp.ring_attention`, `pcp.ulysses_attention`, `pcp.hybrid_attention` with U=2 where N >= 4 is
even), in each dtype the device's kernels take (bf16 and fp32 on a GPU; fp32 on CPU, whose matmul takes no
bf16: probed, not assumed). Each output and gradient, gathered in token order, is compared with the truth: one
device's dense attention in float64 on the same (dtype-rounded) inputs, its error taken relative to the
tensor's largest value (at least 1). The bound is what the dtype allows on this device: 2x one device's own
error (paddle_cp's kernels on the whole sequence, in the dtype: on a GPU, fp32 matmuls may run in TF32, Paddle's
default) or a floor, whichever is larger: 1e-5 for fp32, one bf16 rounding (2^-8) for bf16.

Beside each check: the attention kernels paddle_cp called per rank (flash / flashmask / blockwise, forward and
backward calls, counted through a wrapper of their methods), the Paddle operators run (Paddle's per-dtype
operator counter: calls, the share in the check's dtype, the flash ops' calls); then the bandwidth of the ring
exchange (paddle_cp's p2p shift to the next rank) and of the all-to-all (paddle_cp's all_to_all), from a few
timed exchanges of --exchange-mib per rank, with a check that every rank received what its peers sent. The
table goes to stdout (--json: everything); the exit code is 1 when any check failed, on every rank.

A failure on one rank only never leaves the others waiting out a collective timeout: building a dtype's case
(no collectives) is agreed by one all-reduce, so every rank skips that dtype's checks alike and the table names
the failed ranks; a check that raises inside its exchanges (a kernel failing on one device) ends the run at once
on that rank, exit 1 with its error on stderr, and its peers' exchanges fail at once or the launcher stops them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from paddle_cp.tools.selftest.checks import TENSORS, run_ranks


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, help="ranks (default: inside a launch its ranks, else every GPU, "
                                                  "else 2 CPU ranks)")
    parser.add_argument("--seq", type=int, help="global sequence length (default: 2048 on GPU, 64 x N on CPU)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, help="query heads (default: max(8, N))")
    parser.add_argument("--kv-heads", type=int, help="k/v heads (GQA; default: half the query heads)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, help="sliding window (default: seq / 8)")
    parser.add_argument("--exchange-mib", type=float, help="MiB each rank sends per timed exchange "
                                                           "(default: 64 on GPU, 1 on CPU)")
    parser.add_argument("--iters", type=int, default=5, help="timed exchanges (after one untimed)")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--result-file", help=argparse.SUPPRESS)  # launcher <-> rank 0
    args = parser.parse_args(argv)
    args.nproc = args.nproc or _default_ranks()
    if args.nproc < 1:
        parser.error("--nproc takes at least 1 rank")
    heads = args.heads or max(8, args.nproc)
    kv_heads = args.kv_heads or max(1, heads // 2)
    if heads % kv_heads:
        parser.error(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    if args.seq is not None and args.seq < 4 * args.nproc:
        parser.error(f"--seq {args.seq}: give at least 4 tokens per rank ({4 * args.nproc})")
    args.heads, args.kv_heads = heads, kv_heads
    return args


def _default_ranks():
    if "PADDLE_TRAINERS_NUM" in os.environ:  # inside a launch
        return int(os.environ["PADDLE_TRAINERS_NUM"])
    import paddle

    gpus = paddle.device.cuda.device_count() if paddle.is_compiled_with_cuda() else 0
    return gpus or 2


# ---- the table ------------------------------------------------------------------------------------

def table(result):
    from paddle_cp.tools.text import ruled_table  # here: the ranks run this file as a script

    c = result["config"]
    lines = [f"pcp-selftest: {c['nproc']} rank(s) on {c['device']}; batch {c['batch']} x {c['seq']} tokens of packed "
             f"documents, causal, window {c['window']}; heads {c['heads']}/{c['kv_heads']} x {c['head_dim']}"]
    lines += [f"not run: {reason}" for reason in c["not_run"]]
    head = (f"{'attention':9} {'dtype':8} {'out':>8} {'dq':>8} {'dk':>8} {'dv':>8} {'1 device':>8} {'bound':>8} "
            f"{'result':6}  kernel calls fwd+bwd and Paddle ops (largest rank)")
    rows = []
    for check in result["checks"]:
        start = f"{check['backend']:9} {check['dtype']:8}"
        if "error" in check:
            rows.append(f"{start} FAILED: {check['error'][:200]}")
            continue
        errors = " ".join(f"{check['errors'][t]:8.1e}" for t in TENSORS)
        rows.append(f"{start} {errors} {max(check['one_device'].values()):8.1e} {check['tolerance']:8.1e} "
                    f"{'ok' if check['passed'] else 'FAILED':6}  {_calls(check)}")
    exchange_head = f"{'exchange':10} {'MiB/rank':>9} {'GB/s':>9} {'delivered':9}"
    exchange_rows = [f"{name:10} {e['bytes_per_rank'] / 2 ** 20:9.2f} {e['bytes_per_second'] / 1e9:9.3f} "
                     f"{'ok' if e['delivered'] else 'FAILED':9}" for name, e in result["exchanges"].items()]
    verdict = "PASSED" if result["passed"] else "FAILED"
    return "\n".join([*lines, ruled_table(head, rows), "", ruled_table(exchange_head, exchange_rows), verdict])


def _calls(check):
    """The largest rank's kernel calls and operator figures of a check (the ranks differ by their share)."""
    kernels = {}
    for per_rank in check["kernels_per_rank"]:
        for name, counts in per_rank.items():
            kernels[name] = max(kernels.get(name, (0, 0)), (counts["forward"], counts["backward"]))
    ops = max(check["ops_per_rank"], key=lambda o: o["calls"])
    attention_ops = ", ".join(f"{op} {n}" for op, n in ops["attention_ops"].items())
    return (", ".join(f"{name} {f}+{b}" for name, (f, b) in sorted(kernels.items())) +
            f"; {ops['calls']} ops of {ops['operators']} kinds, {ops['in_dtype']} in {check['dtype']}"
            + (f" ({attention_ops})" if attention_ops else ""))


# ---- entry points ---------------------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "PADDLE_TRAINER_ID" not in os.environ:  # start the ranks (bench's launcher: one per GPU when there are)
        from paddle_cp.tools.launcher import launch

        result = launch(args, argv, script=__file__)
    else:
        result = run_ranks(args)
        if args.result_file:
            import paddle.distributed as dist

            if dist.get_rank() == 0:
                Path(args.result_file).write_text(json.dumps(result))
            return
    finish(result, args)


def finish(result, args):
    import paddle.distributed as dist

    if "PADDLE_TRAINER_ID" not in os.environ or dist.get_rank() == 0:
        from paddle_cp.tools.text import show  # here: the ranks run this file as a script

        show(table(result), result, args.json)
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
