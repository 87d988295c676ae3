"""paddle_cp's GPU path on CPU ranks: the flash and flashmask kernels over the emulated `flash_attn` and
`flashmask_attention` ops, ring exchanges over the emulated asynchronous p2p group (emulated_flash.py,
emulated_async.py).

Modes (argv): `parity` runs every backend and rotation in bf16 (one case fp16) through the flash path and
through the blockwise kernel on the same inputs, both also against fp32 SDPA, with the
overlap and misuse checks of the async emulation; `bf16` measures the error of a bf16 ring
(flash path) against fp32 attention for the error-vs-N table.
"""
import sys

import emulated_async
import emulated_flash
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle import _C_ops
from report import run
from visibility import visible

import paddle_cp as pcp
from paddle_cp import mesh as mesh_lib
from paddle_cp import runtime
from paddle_cp.attention import kernels
from paddle_cp.attention.kernels import flash as flash_kernel, flashmask as flashmask_kernel
from paddle_cp.comm import counters, p2p

HEAD_DIM = 32  # flash_attn needs d % 8 == 0
BF16 = paddle.bfloat16
_calls = {"flash_attn": 0, "flash_attn_grad": 0, "flashmask_attention": 0, "flashmask_attention_grad": 0,
          "blockwise": 0, "overlapped": 0, "grad_overlapped": 0}


def _observed_flash():
    """Count the emulated ops' calls (and those made while an exchange is in flight) and the blockwise
    kernel's forwards and backwards."""
    def observed(name, op, overlap_key):
        def call(*args):
            _calls[name] += 1
            _calls[overlap_key] += bool(emulated_async.in_flight())
            return op(*args)
        return call

    for name in ("flash_attn", "flashmask_attention"):
        setattr(_C_ops, name, observed(name, getattr(_C_ops, name), "overlapped"))
        setattr(_C_ops, name + "_grad", observed(name + "_grad", getattr(_C_ops, name + "_grad"), "grad_overlapped"))
    for method in ("forward", "backward"):
        original = getattr(kernels.BlockwiseKernel, method)
        setattr(kernels.BlockwiseKernel, method,
                lambda self, *args, original=original: _calls.__setitem__("blockwise", _calls["blockwise"] + 1)
                or original(self, *args))


def cases(n):
    """(name, backend, ulysses_degree, causal, batch, seq, q_heads, kv_heads, masking, rotate, scale);
    masking: "" (causal or full only), "docs" (packed documents), "docs_layout" (packed documents in the
    documents layout: the ranks' positions scattered, short pieces sharing tiles), "packed" (many documents of
    2-9 tokens: every ring step cuts several), "one_way" (a document per chunk but the last two chunks': rank 0
    reads rank 1's block, which reads nothing of rank 0's, so planned exchange steps with one side empty) or
    "window" (sliding window of seq // 3)."""
    table = [
        ("p2p.causal.uneven", "p2p", None, True, 2, 6 * n + 1, 4, 2, "", "planned", None),
        ("p2p.causal.uneven.allgather", "p2p", None, True, 1, 6 * n + 3, 2, 1, "", "allgather", None),
        ("p2p.full.scale", "p2p", None, False, 1, 4 * n + 3, 4, 4, "", "planned", 0.3),
        ("p2p.docs", "p2p", None, True, 1, 5 * n + 2, 2, 1, "docs", "planned", None),
        ("p2p.docs_layout", "p2p", None, True, 2, 24 * n + 5, 2, 1, "docs_layout", "planned", None),
        ("p2p.packed.docs", "p2p", None, True, 2, 40 * n + 3, 2, 1, "packed", "planned", None),
        ("p2p.one_way.docs", "p2p", None, True, 1, 8 * n, 2, 1, "one_way", "planned", None),
        ("all2all.causal.uneven_heads", "all2all", None, True, 2, 3 * n + 1, n + 1, 1, "", "planned", None),
        ("all2all.full", "all2all", None, False, 1, 4 * n, 2 * n, n, "", "planned", None),
        ("all2all.docs", "all2all", None, True, 1, 4 * n + 3, n, n, "docs", "planned", None),
        ("p2p.causal.fp16", "p2p", None, True, 1, 4 * n + 1, 2, 1, "", "planned", None),
        ("p2p.window", "p2p", None, True, 1, 8 * n + 3, 4, 2, "window", "planned", None),
        ("all2all.window", "all2all", None, True, 1, 6 * n + 1, n, 1, "window", "planned", None),
    ]
    if n == 4:
        table += [
            ("hybrid.causal.uneven", "hybrid", 2, True, 2, 29, 4, 2, "", "planned", None),
            ("hybrid.causal.allgather", "hybrid", 2, True, 1, 30, 4, 2, "", "allgather", None),
            ("hybrid.docs", "hybrid", 2, True, 1, 27, 2, 2, "docs", "planned", None),
        ]
    return table


def layout_doc_ids(batch, seq):
    """Long and short documents (one of 2 tokens), different per row: the 2N chunks leave them unbalanced."""
    ends = [[seq // 2, seq // 2 + 2, seq], [3, seq // 3, seq]]
    return np.stack([np.searchsorted(np.array(row[:-1]), np.arange(seq), side="right") for row in ends[:batch]])


def packed_doc_ids(batch, seq):
    """Documents of 2-9 tokens, different per row."""
    rng = np.random.RandomState(7)
    return np.stack([np.repeat(np.arange(seq), rng.randint(2, 10, size=seq))[:seq] for _ in range(batch)])


def visible_steps(case, world, rank, doc_ids, window):
    """(ring steps in which some query of this rank sees some key of the step's block, those of them that
    flash_attn computes), read off the whole sequence's mask, apart from paddle_cp's planning: each direction
    makes one op call per such step, a flash_attn call where the block trimmed to the rows and keys anyone
    sees is all visible or plain causal over the same positions, a flashmask_attention call otherwise."""
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout
    from paddle_cp.attention.masks.block_mask import Documents

    _, backend, degree, causal, _, seq, _, _, masking, _, _ = case
    layout = SequenceLayout(backend, world, degree)
    if masking == "docs_layout":
        layout = layout.for_batch(Documents.from_ids(doc_ids))
    seen = visible(seq, causal, doc_ids, window)
    mine = layout.group_positions(seq, rank // layout.ulysses)
    steps = flash = 0
    for group in range(layout.ring):
        theirs = layout.group_positions(seq, group)
        block = seen[:, mine][:, :, theirs]  # [b, q, k]
        rows, keys = np.flatnonzero(block.any(axis=(0, 2))), np.flatnonzero(block.any(axis=(0, 1)))
        if not len(rows):
            continue
        steps += 1
        block = block[:, rows[0]:rows[-1] + 1, keys[0]:keys[-1] + 1]
        same = np.array_equal(mine[rows[0]:rows[-1] + 1], theirs[keys[0]:keys[-1] + 1])
        flash += bool(block.all() or (same and (block == np.tri(len(block[0]), dtype=bool)).all()))
    return steps, flash


def one_way_doc_ids(batch, seq):
    """A document per 2N chunk, the last two chunks one document."""
    from paddle_cp.cost.packed_layout import chunk_sizes

    ids = np.repeat(np.arange(2 * dist.get_world_size()), chunk_sizes(seq, dist.get_world_size()))
    return np.tile(np.minimum(ids, ids[-1] - 1), (batch, 1))


def doc_ids_for(batch, seq):
    rng = np.random.RandomState(3)
    ids = np.zeros([batch, seq], dtype="int64")
    for row in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=2, replace=False))
        ids[row] = np.searchsorted(cuts, np.arange(seq), side="right")
    return ids


def fp32_reference(q, k, v, grad_out, causal, scale, doc_ids, window=None):
    """fp32 SDPA on the (bf16-valued) inputs: output and q/k/v gradients."""
    full = [t.astype("float32").detach() for t in (q, k, v)]
    for t in full:
        t.stop_gradient = False
    seq = q.shape[1]
    if doc_ids is not None:
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        mask = paddle.to_tensor((same & np.tri(seq, dtype=bool))[:, None])
        out = F.scaled_dot_product_attention(*full, attn_mask=mask, scale=scale)
    elif window is not None:  # query i sees keys i - window < j <= i
        mask = paddle.to_tensor((np.tri(seq, dtype=bool) & ~np.tri(seq, k=-window, dtype=bool))[None, None])
        out = F.scaled_dot_product_attention(*full, attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(*full, is_causal=causal, scale=scale)
    return [out, *paddle.grad([out], full, [grad_out.astype("float32")])]


def documents_layout(mesh, case, q, k, v, grad_out, doc_ids):
    """As context_parallel, in the documents layout a PrepareContextParallel(documents=...) plan gives the batch."""
    from paddle_cp.attention import context_parallel_attention, resolve_groups
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout
    from paddle_cp.attention.masks.block_mask import Documents

    _, backend, degree, causal, _, seq, _, _, _, rotate, scale = case
    plan = pcp.PrepareContextParallel(backend, degree, documents="doc_ids")
    documents = Documents.from_ids(doc_ids)
    layout = SequenceLayout(backend, mesh.shape[0], degree).for_batch(documents)
    assert layout.split.name == "documents"
    local = [pcp.shard_sequence(t, backend=plan, mesh=mesh, doc_ids=doc_ids).detach() for t in (q, k, v)]
    for t in local:
        t.stop_gradient = False
    out = context_parallel_attention(layout, resolve_groups(layout, mesh), *local, is_causal=causal, scale=scale,
                                     seq_len=seq, documents=documents, rotate=rotate)
    full_out = pcp.unshard_sequence(out.astype("float32"), backend=plan, mesh=mesh, seq_len=seq, doc_ids=doc_ids)
    grads = paddle.grad([full_out], local, [grad_out.astype("float32")])
    return [full_out] + [g.astype("float32") for g in grads]


def context_parallel(mesh, case, q, k, v, grad_out, doc_ids, window=None):
    """Output (gathered) and this rank's q/k/v gradient shards, in fp32."""
    name, backend, degree, causal, batch, seq, _, _, masking, rotate, scale = case
    if masking == "docs_layout":
        return documents_layout(mesh, case, q, k, v, grad_out, doc_ids)
    layout = dict(backend=backend, mesh=mesh, ulysses_degree=degree)
    local = [pcp.shard_sequence(t, **layout).detach() for t in (q, k, v)]
    for t in local:
        t.stop_gradient = False
    attention = {"p2p": pcp.ring_attention, "all2all": pcp.ulysses_attention, "hybrid": pcp.hybrid_attention}[backend]
    extra = {"ulysses_degree": degree} if degree else {}
    out = attention(*local, is_causal=causal, scale=scale, mesh=mesh, seq_len=seq, doc_ids=doc_ids, rotate=rotate,
                    window=window, **extra)
    # gathered in fp32 (exact for half values; CPU has no fp16 index_select)
    full_out = pcp.unshard_sequence(out.astype("float32"), seq_len=seq, **layout)
    grads = paddle.grad([full_out], local, [grad_out.astype("float32")])
    return [full_out] + [g.astype("float32") for g in grads]


def relative(got, want):
    """max |got - want| / max |want|: bf16 rounding is relative to the values' scale."""
    got, want = got.numpy(), want.numpy()
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def check_case(report, mesh, case):
    name, backend, degree, causal, batch, seq, q_heads, kv_heads, masking, rotate, scale = case
    paddle.seed(1234)
    dtype = paddle.float16 if name.endswith(".fp16") else BF16
    q, k, v, grad_out = (paddle.randn([batch, seq, heads, HEAD_DIM]).astype(dtype)
                         for heads in (q_heads, kv_heads, kv_heads, q_heads))
    doc_ids = {"docs": doc_ids_for, "docs_layout": layout_doc_ids, "packed": packed_doc_ids,
               "one_way": one_way_doc_ids}.get(
        masking, lambda *_: None)(batch, seq)
    window = seq // 3 if masking == "window" else None
    layout = dict(backend=backend, mesh=mesh, ulysses_degree=degree)
    reference = fp32_reference(q, k, v, grad_out, causal, scale, doc_ids, window)
    if masking == "docs_layout":  # the gradients' shards in the batch's documents layout
        layout = dict(backend=pcp.PrepareContextParallel(backend, degree, documents="doc_ids"), mesh=mesh,
                      doc_ids=doc_ids)
    reference = reference[:1] + [pcp.shard_sequence(g, **layout) for g in reference[1:]]

    flash_kernel.flash_available = flashmask_kernel.flashmask_available = lambda: False
    blockwise = context_parallel(mesh, case, q, k, v, grad_out, doc_ids, window)
    flash_kernel.flash_available = flashmask_kernel.flashmask_available = lambda: True
    before, posted = dict(_calls), dict(emulated_async.posted)
    flash = context_parallel(mesh, case, q, k, v, grad_out, doc_ids, window)
    calls = {key: _calls[key] - before[key] for key in _calls}
    report.value(f"{name}.posted", {key: emulated_async.posted[key] - posted[key] for key in posted})
    for label, got, block, want in zip(("out", "dq", "dk", "dv"), flash, blockwise, reference):
        report.value(f"{name}.{label}.vs_blockwise", relative(got, block))
        report.value(f"{name}.{label}.vs_fp32", relative(got, want))
        report.value(f"{name}.{label}.blockwise_vs_fp32", relative(block, want))
    report.value(f"{name}.calls", calls)
    steps, flash_steps = visible_steps(case, dist.get_world_size(), dist.get_rank(), doc_ids, window)
    report.value(f"{name}.steps", steps)
    report.value(f"{name}.flash_steps", flash_steps)
    report.value(f"{name}.left_in_flight", len(emulated_async.in_flight()))


def check_misuse(report, mesh):
    """Every rank makes the same mistake, so all raise before any message moves."""
    group = mesh_lib.mesh_group(mesh, ["sep"], p2p=True)
    x = paddle.arange(6, dtype="float32") + 10 * group.index

    sent = x.clone()
    pending = p2p.shift(group, sent, 1)
    sent.scale_(2.0)  # changed while in flight
    report.expect_error("modified_send", pending.wait)

    pending = p2p.shift(group, x, 1)
    pending._buffer.fill_(0.0)
    report.expect_error("written_receive", pending.wait)

    pending = p2p.shift(group, x, 1)
    report.value("read_before_wait_is_nan", bool(paddle.isnan(pending._buffer).all()))
    got = pending.wait()
    report.value("received_after_wait", got.numpy().tolist())
    report.value("expected_after_wait", (paddle.arange(6, dtype="float32") + 10 * ((group.index - 1) % group.size))
                 .numpy().tolist())
    report.value("misuse.left_in_flight", len(emulated_async.in_flight()))


def measure_bf16(report, mesh):
    """A bf16 causal ring (flash path) against fp32 attention on the same bf16 values."""
    batch, seq, heads = 1, 256, 2
    paddle.seed(99)
    q, k, v, grad_out = (paddle.randn([batch, seq, heads, HEAD_DIM]).astype(BF16) for _ in range(4))
    case = ("bf16", "p2p", None, True, batch, seq, heads, heads, "", "planned", None)
    reference = fp32_reference(q, k, v, grad_out, True, None, None)
    got = context_parallel(mesh, case, q, k, v, grad_out, None)
    for label, mine, want in zip(("out", "dq", "dk", "dv"), got, reference):
        want = want if label == "out" else pcp.shard_sequence(want, mesh=mesh)
        err = np.abs(mine.numpy() - want.numpy())
        report.value(f"bf16.{label}.max", float(err.max()))
        report.value(f"bf16.{label}.sum", float(err.sum()))
        report.value(f"bf16.{label}.count", int(err.size))
        report.value(f"bf16.{label}.scale", float(np.abs(want.numpy()).max()))


def main(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    emulated_flash.install()
    emulated_async.install()
    _observed_flash()
    modes = sys.argv[1:]
    if "parity" in modes:
        for case in cases(world):
            check_case(report, mesh, case)
        if world > 1:
            check_misuse(report, mesh)
        # bytes: the emulated all-to-all's rounds shift too, inside one collective, which counts no other call
        report.value("communicator_start_bytes", counters.bytes_sent(p2p.COMMUNICATOR_START))
        report.value("communicators_started", len(runtime.installed.started_communicators))
    if "bf16" in modes:
        measure_bf16(report, mesh)


run(main)
