"""pcp-selftest: does context-parallel attention compute, on this machine's devices, what one device does?

    pcp-selftest --nproc 8                      (starts 8 ranks: one per GPU, or CPU ranks on gloo)
    python -m paddle.distributed.launch --nproc_per_node 8 paddle_cp/tools/selftest.py   (inside a launch)

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
import functools
import json
import os
import sys
import time
from pathlib import Path

FLOOR = {"float32": 1e-5, "bfloat16": 2.0 ** -8}  # bf16: one rounding of a result, relative to its scale
ONE_DEVICE_FACTOR = 2  # as close to the truth as one device, within this factor
BACKENDS = {"p2p": "ring_attention", "all2all": "ulysses_attention", "hybrid": "hybrid_attention"}
HYBRID_ULYSSES = 2
TENSORS = ("out", "dq", "dk", "dv")
ATTENTION_OPS = ("flash_attn", "flash_attn_grad", "flashmask_attention", "flashmask_attention_grad")


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


# ---- what the ranks run ---------------------------------------------------------------------------

class KernelCalls:
    """Forward and backward calls of each attention kernel while active, by kernel name: a wrapper around the
    class that defines each method (a kernel inheriting it is counted under its own name)."""

    def __init__(self):
        from paddle_cp.attention.kernels import BlockwiseKernel, FlashKernel, FlashMaskKernel

        self.classes = {FlashMaskKernel: "flashmask", FlashKernel: "flash", BlockwiseKernel: "blockwise"}
        self.calls, self._saved = {}, []

    def _name(self, kernel):
        return next(name for cls, name in self.classes.items() if isinstance(kernel, cls))

    def _counted(self, method, direction):
        @functools.wraps(method)
        def call(kernel, *args, **kwargs):
            counts = self.calls.setdefault(self._name(kernel), {"forward": 0, "backward": 0})
            counts[direction] += 1
            return method(kernel, *args, **kwargs)
        return call

    def __enter__(self):
        for cls in self.classes:
            for direction in ("forward", "backward"):
                owner = next((c for c in cls.__mro__ if direction in c.__dict__), None)
                if owner is not None and all((owner, direction) != saved[:2] for saved in self._saved):
                    method = owner.__dict__[direction]
                    self._saved.append((owner, direction, method))
                    setattr(owner, direction, self._counted(method, direction))
        return self

    def __exit__(self, *exc):
        for cls, direction, method in self._saved:
            setattr(cls, direction, method)
        self._saved = []


def _documents(batch, seq):
    """[b, seq] document ids: uneven documents, a different packing per row, several crossing the ranks'
    shares (fractions of the sequence, so any length and rank count gets the same shape of batch)."""
    import numpy as np

    rows = []
    for row in range(batch):
        fractions = (0.31, 0.07, 0.22, 0.4) if row % 2 == 0 else (0.05, 0.5, 0.13, 0.32)
        ends = np.minimum(np.cumsum(np.maximum(1, np.round(np.array(fractions) * seq))).astype(int), seq)
        ends[-1] = seq
        rows.append(np.searchsorted(ends, np.arange(seq), side="right"))
    return np.stack(rows).astype("int64")


def _allowed(doc_ids, window):
    """[b, 1, s, s] bool: query i sees key j in its own document, j <= i, i - window < j."""
    import numpy as np

    seq = doc_ids.shape[1]
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & (j <= i) & (j > i - window))[:, None]


def dense_attention(q, k, v, allowed, scale):
    """Plain softmax attention over a dense mask, in q's dtype. q [b, s, h, d], k/v [b, s, h_k, d]."""
    import paddle
    import paddle.nn.functional as F

    repeat = q.shape[2] // k.shape[2]
    k, v = (paddle.repeat_interleave(x, repeat, axis=2) for x in (k, v))  # [b, s, h, d]: query head i, kv i // repeat
    scores = paddle.matmul(q.transpose([0, 2, 1, 3]), k.transpose([0, 2, 3, 1])) * scale  # [b, h, s, s]
    scores = paddle.where(allowed, scores, paddle.full_like(scores, float("-inf")))
    return paddle.matmul(F.softmax(scores, axis=-1), v.transpose([0, 2, 1, 3])).transpose([0, 2, 1, 3])


def _with_grads(attention, inputs, dout):
    """[out, dq, dk, dv] of one forward and backward."""
    import paddle

    leaves = [x.detach() for x in inputs]
    for leaf in leaves:
        leaf.stop_gradient = False
    out = attention(*leaves)
    return [out, *paddle.grad([out], leaves, [dout])]


def _error(got, truth):
    """Largest difference, relative to the truth's largest value where that exceeds 1."""
    got, truth = got.astype("float64"), truth.astype("float64")
    return float((got - truth).abs().max()) / max(1.0, float(truth.abs().max()))


class Case:
    """The global batch of one dtype on this device, and its truth and one-device errors."""

    def __init__(self, args, dtype):
        import numpy as np
        import paddle

        from paddle_cp.attention.kernels import local_attention
        from paddle_cp.attention.masks.block_mask import BlockMask, Documents

        self.dtype, self.seq, self.window = dtype, args.seq, args.window
        self.scale = args.head_dim ** -0.5
        rng = np.random.RandomState(2024)
        shapes = [(args.heads,), (args.kv_heads,), (args.kv_heads,), (args.heads,)]
        self.inputs = [paddle.to_tensor(rng.standard_normal((args.batch, args.seq, *h, args.head_dim)).astype("float32"))
                       .astype(dtype) for h in shapes]  # q, k, v, dout (rounded to the dtype)
        self.doc_ids = _documents(args.batch, args.seq)
        allowed = paddle.to_tensor(_allowed(self.doc_ids, args.window))
        wide = [x.astype("float64") for x in self.inputs]  # float64: no TF32, no rounding of note
        self.truth = _with_grads(lambda q, k, v: dense_attention(q, k, v, allowed, self.scale), wide[:3], wide[3])
        positions = np.arange(args.seq)
        mask = BlockMask(positions, positions, True, Documents.from_ids(self.doc_ids), window=args.window)
        one_device = _with_grads(lambda q, k, v: local_attention(q, k, v, True, self.scale, mask=mask),
                                 self.inputs[:3], self.inputs[3])
        self.one_device = {name: _error(x, t) for name, x, t in zip(TENSORS, one_device, self.truth)}

    def tolerance(self):
        return max(FLOOR[self.dtype], ONE_DEVICE_FACTOR * max(self.one_device.values()))


def check_backend(pcp, mesh, case, backend):
    """This rank's figures of one backend on one case: errors of the gathered output and gradients, kernel
    calls, operator calls."""
    from paddle_cp.api.operator_calls import operator_calls

    degree = HYBRID_ULYSSES if backend == "hybrid" else None
    layout = dict(backend=backend, mesh=mesh, ulysses_degree=degree)
    shards = [pcp.shard_sequence(x, **layout) for x in case.inputs]
    function = getattr(pcp, BACKENDS[backend])
    extra = {"ulysses_degree": degree} if degree else {}

    def attention(q, k, v):
        return function(q, k, v, is_causal=True, mesh=mesh, seq_len=case.seq, doc_ids=case.doc_ids,
                        window=case.window, **extra)

    with KernelCalls() as kernels, operator_calls() as ops:
        local = _with_grads(attention, shards[:3], shards[3])
    whole = [pcp.unshard_sequence(x.detach(), seq_len=case.seq, **layout) for x in local]
    return {"errors": {name: _error(x, t) for name, x, t in zip(TENSORS, whole, case.truth)},
            "kernels": kernels.calls, "ops": ops}


def exchange_bandwidth(group, nbytes, iters, synchronize):
    """{exchange: (bytes this rank sends per exchange, seconds per exchange, delivered)} for the ring shift
    and the all-to-all, each rank sending `nbytes` in all (the all-to-all keeps 1/N of it home)."""
    import paddle
    import paddle.distributed as dist

    from paddle_cp.comm import collectives, p2p

    n, me = group.size, group.index
    elements = max(n, nbytes // 4 // n * n)  # int32: every value below 2^31 is exact (float32's stop at 2^24)
    mine = paddle.full([elements], me, "int32")
    chunks = list(paddle.split(paddle.arange(elements, dtype="int32") + me * elements, n))  # chunk j to position j

    def ring():
        return p2p.shift(group, mine, 1, tag="selftest").wait()

    def all_to_all():
        return collectives.all_to_all(group, chunks, tag="selftest")

    received = ring()
    ring_ok = bool((received == (me - 1) % n).all())
    parts = all_to_all()
    size = elements // n
    expect = [paddle.arange(me * size, (me + 1) * size, dtype="int32") + j * elements for j in range(n)]
    all_to_all_ok = all(bool((got == want).all()) for got, want in zip(parts, expect))

    def seconds(exchange):
        dist.barrier()
        synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            exchange()
        synchronize()
        return (time.perf_counter() - start) / iters

    sent = elements * 4
    return {"ring": (sent if n > 1 else 0, seconds(ring), ring_ok),
            "all_to_all": (sent * (n - 1) // n, seconds(all_to_all), all_to_all_ok)}


def _bf16_matmul_runs():
    """Whether this device's matmul takes bfloat16 (CPU builds register none)."""
    import paddle

    try:
        x = paddle.ones([2, 2], "bfloat16")
        paddle.matmul(x, x)
        return True
    except (RuntimeError, NotImplementedError, ValueError):
        return False


def run_ranks(args):
    """Every check on this rank; the summary (the same on every rank)."""
    import paddle
    import paddle.distributed as dist

    import paddle_cp as pcp
    from paddle_cp.attention.dispatch.groups import resolve_group

    if not dist.is_initialized():
        dist.init_parallel_env()
    world = dist.get_world_size()
    if world != args.nproc:
        raise ValueError(f"launched on {world} ranks but --nproc is {args.nproc}")
    on_gpu = paddle.device.get_device().startswith("gpu")
    args.seq = args.seq or (2048 if on_gpu else 64 * world)
    args.window = args.window or max(1, args.seq // 8)
    mib = args.exchange_mib or (64 if on_gpu else 1)
    synchronize = paddle.device.synchronize if on_gpu else (lambda: None)
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    group = resolve_group(mesh)
    dtypes = ["bfloat16", "float32"] if _bf16_matmul_runs() else ["float32"]
    backends = [b for b in BACKENDS if b != "hybrid" or (world >= 2 * HYBRID_ULYSSES and world % HYBRID_ULYSSES == 0)]
    mine = {"checks": [], "exchanges": exchange_bandwidth(group, int(mib * 2 ** 20), args.iters, synchronize)}
    for dtype in dtypes:
        try:
            case, failure = Case(args, dtype), None
        except Exception as error:  # noqa: BLE001 - reported in the table, agreed below
            case, failure = None, f"{type(error).__name__}: {error}"
        failed_on = failed_ranks(group, failure is not None)
        if failed_on:  # every rank skips the dtype's checks alike: none issues their collectives
            mine["checks"].append({"dtype": dtype, "backend": "one device", "failed_on": failed_on,
                                   **({"error": failure} if failure else {})})
            continue
        for backend in backends:
            row = {"dtype": dtype, "backend": backend, "one_device": case.one_device, "tolerance": case.tolerance()}
            try:
                row.update(check_backend(pcp, mesh, case, backend))
            except Exception as error:  # noqa: BLE001 - see end_run
                end_run(row, error)
            mine["checks"].append(row)
    every = []
    dist.all_gather_object(every, mine)
    device = paddle.device.cuda.get_device_name() if on_gpu else "cpu"
    return summarise(args, every, device, dtypes, backends, mib)


def failed_ranks(group, failed_here):
    """The ranks on which a step failed, agreed by one all-reduce that every rank takes part in (failed or not),
    so a failure on one rank stops the same checks everywhere instead of leaving its peers waiting in them."""
    import paddle

    from paddle_cp.comm import collectives

    flags = paddle.zeros([group.size], "int32")
    flags[group.index] = int(failed_here)
    collectives.all_reduce(group, flags, tag="selftest_agree")
    return [group.ranks[i] for i in flags.numpy().nonzero()[0]]


def end_run(row, error):
    """A check raised on this rank while its peers may be waiting in that check's exchanges for messages this
    rank will not send (a kernel failing on one device, out of memory on one rank): no later collective would
    line up, so this rank reports and exits 1 at once. Its peers' exchanges then fail at once (gloo: its
    connections close) and they end the same way, or the launcher stops them (it stops every rank when one
    fails): no rank waits out a collective timeout."""
    import paddle.distributed as dist

    sys.stdout.flush()
    sys.stderr.write(f"pcp-selftest: rank {dist.get_rank()}: {row['backend']} attention in {row['dtype']} FAILED: "
                     f"{type(error).__name__}: {error}\npcp-selftest: FAILED (rank {dist.get_rank()} ends the run, "
                     "exit 1)\n")
    sys.stderr.flush()
    os._exit(1)


def summarise(args, every, device, dtypes, backends, mib):
    """One summary from every rank's figures: errors at their largest over ranks, each rank's calls."""
    checks = []
    for i, row in enumerate(every[0]["checks"]):
        rows = [rank["checks"][i] for rank in every]
        merged = {k: v for k, v in row.items() if k not in ("errors", "kernels", "ops")}
        errors = [r.get("error") for r in rows if r.get("error")]
        if errors:
            merged["error"] = f"on rank(s) {row['failed_on']}: {errors[0]}" if "failed_on" in row else errors[0]
        else:
            merged["errors"] = {t: max(r["errors"][t] for r in rows) for t in TENSORS}
            merged["kernels_per_rank"] = [r["kernels"] for r in rows]
            merged["ops_per_rank"] = [_op_summary(r["ops"], row["dtype"]) for r in rows]
            merged["passed"] = max(merged["errors"].values()) <= row["tolerance"]
        merged.setdefault("passed", False)
        checks.append(merged)
    exchanges = {}
    for name in ("ring", "all_to_all"):
        per_rank = [rank["exchanges"][name] for rank in every]
        exchanges[name] = {"bytes_per_rank": per_rank[0][0], "seconds": max(s for _, s, _ in per_rank),
                           "bytes_per_second": min(b / s for b, s, _ in per_rank) if per_rank[0][0] else 0.0,
                           "delivered": all(ok for _, _, ok in per_rank)}
    missing = [b for b in BACKENDS if b not in backends]
    return {"config": {"nproc": args.nproc, "device": device, "seq": args.seq, "batch": args.batch,
                       "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                       "window": args.window, "exchange_mib": mib, "dtypes": dtypes,
                       "not_run": ([f"hybrid: needs an even N >= {2 * HYBRID_ULYSSES}"] if missing else [])
                       + ([] if "bfloat16" in dtypes else ["bfloat16: this device's matmul takes none"])},
            "checks": checks, "exchanges": exchanges,
            "passed": all(c["passed"] for c in checks) and all(e["delivered"] for e in exchanges.values())}


def _op_summary(ops, dtype):
    """{calls, in_dtype (calls in the check's dtype), attention ops' calls} of one rank's operator counts."""
    column = dtype if dtype in ("bfloat16", "float32") else "other"
    return {"calls": sum(sum(c.values()) for c in ops.values()),
            "in_dtype": sum(c.get(column, 0) for c in ops.values()),
            "operators": len(ops),
            "attention_ops": {op: sum(ops[op].values()) for op in ATTENTION_OPS if op in ops}}


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
