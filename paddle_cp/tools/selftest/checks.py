"""pcp-selftest's checks, as each rank runs them: the case of each dtype (its truth in float64, one device's
error), every backend's attention against it with the kernels and operators it called, the exchanges' bandwidth
(exchanges.py), failures agreed across ranks, and the summary every rank returns."""
from __future__ import annotations

import functools
import os
import sys

from paddle_cp.tools.ranks import sep_mesh
from paddle_cp.tools.selftest.exchanges import exchange_bandwidth

FLOOR = {"float32": 1e-5, "bfloat16": 2.0 ** -8}  # bf16: one rounding of a result, relative to its scale
ONE_DEVICE_FACTOR = 2  # as close to the truth as one device, within this factor
BACKENDS = {"p2p": "ring_attention", "all2all": "ulysses_attention", "hybrid": "hybrid_attention"}
HYBRID_ULYSSES = 2
TENSORS = ("out", "dq", "dk", "dv")
ATTENTION_OPS = ("flash_attn", "flash_attn_grad", "flashmask_attention", "flashmask_attention_grad")


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


def _bf16_matmul_runs():
    """Whether this device's matmul takes bfloat16 (CPU builds register none)."""
    from paddle_cp.dtypes import matmul_takes

    return matmul_takes("bfloat16")


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
    mesh = sep_mesh(world)
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
