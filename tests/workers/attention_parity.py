"""Context-parallel attention vs one process's F.scaled_dot_product_attention.

Every rank computes the single-process reference from the same seed, runs the
context-parallel version on its shard, gathers the output and compares output
and q/k/v gradients. Cases cover every backend, sequence lengths that do not
divide, head counts that do not divide, documents, dense masks (boolean and
additive), both k/v rotations and a non-default scale.
"""
from typing import NamedTuple, Optional

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.distributed.fleet.utils import recompute
from report import run

import paddle_cp as pcp
from paddle_cp.attention import context_parallel_attention, resolve_groups
from paddle_cp.attention.layout.exchange_plan import ExchangePlan, exchange_bytes
from paddle_cp.attention.layout.sequence_layout import SequenceLayout
from paddle_cp.attention.masks.block_mask import Documents
from paddle_cp.attention.algorithms.ulysses import head_split
from paddle_cp.comm import counters
from paddle_cp.cost import exchange as cost_exchange
from paddle_cp.tools import packing

HEAD_DIM = 8


class Case(NamedTuple):
    name: str
    backend: str
    causal: bool
    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    degree: Optional[int] = None  # ulysses_degree (hybrid)
    mask: Optional[str] = None    # None, "docs", "bool", "head_bool", "additive" or "own_block"
    rotate: str = "planned"
    scale: Optional[float] = None


def cases(world):
    n = world
    table = [
        Case("p2p.causal.even", "p2p", True, 2, 6 * n, 4, 2),
        Case("p2p.causal.uneven.allgather", "p2p", True, 1, 6 * n + 1, 4, 2, rotate="allgather"),
        Case("p2p.full.uneven.scale", "p2p", False, 1, 4 * n + 3, 4, 4, scale=0.3),
        Case("p2p.causal.docs", "p2p", True, 2, 5 * n + 2, 4, 1, mask="docs"),
        Case("p2p.docs.allgather", "p2p", True, 1, 5 * n + 3, 2, 2, mask="docs", rotate="allgather"),
        Case("p2p.bool_mask", "p2p", False, 2, 4 * n + 1, 4, 2, mask="bool"),
        Case("p2p.additive_mask", "p2p", False, 1, 4 * n + 2, 2, 1, mask="additive"),
        Case("p2p.own_block_mask", "p2p", False, 1, 4 * n + 1, 2, 1, mask="own_block"),
        Case("all2all.causal.uneven_heads", "all2all", True, 2, 3 * n + 1, n + 1, 1),
        Case("all2all.full.even", "all2all", False, 1, 4 * n, 2 * n, n),
        Case("all2all.docs.uneven_heads", "all2all", True, 2, 4 * n + 3, n + 1, n + 1, mask="docs"),
        Case("all2all.head_mask", "all2all", False, 1, 3 * n + 2, n + 1, 1, mask="head_bool"),
    ]
    if n == 4:
        table += [
            Case("hybrid.causal.uneven_heads", "hybrid", True, 2, 29, 3, 1, degree=2),
            Case("hybrid.docs.allgather", "hybrid", True, 1, 30, 4, 2, degree=2, mask="docs", rotate="allgather"),
            Case("hybrid.additive_mask", "hybrid", False, 1, 27, 2, 2, degree=2, mask="additive"),
        ]
    return table


def documents(batch, seq, rng):
    """Per-token document ids: 2-4 documents of random lengths per row."""
    ids = np.zeros([batch, seq], dtype="int64")
    for row in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=rng.randint(1, 4), replace=False))
        ids[row] = np.searchsorted(cuts, np.arange(seq), side="right")
    return ids


def dense_mask(kind, batch, seq, heads, rng):
    """A [b, 1|h, s, s] mask every query row of which sees at least its own key. "own_block": block-diagonal
    over the ring layout's members, but the last member's queries see every key: the others' tiles read no
    other member's keys, which the exchange plan (row bounds only) still counts as read."""
    if kind == "own_block":
        members = SequenceLayout("p2p", dist.get_world_size()).ring_positions(seq)
        owner = np.zeros(seq, "int64")
        for member, positions in enumerate(members):
            owner[positions] = member
        seen = (owner[:, None] == owner[None]) | (owner[:, None] == len(members) - 1)
        return paddle.to_tensor(np.broadcast_to(seen, [batch, 1, seq, seq]).copy())
    seen = rng.rand(batch, heads if kind == "head_bool" else 1, seq, seq) < 0.6
    seen |= np.eye(seq, dtype=bool)
    if kind == "additive":
        return paddle.to_tensor(np.where(seen, 0.0, np.finfo(np.float32).min).astype("float32"))
    return paddle.to_tensor(seen)


def check_case(report, mesh, case):
    batch, seq, scale = case.batch, case.seq, case.scale
    paddle.seed(1234)
    rng = np.random.RandomState(5)
    q = paddle.randn([batch, seq, case.q_heads, HEAD_DIM])
    k = paddle.randn([batch, seq, case.kv_heads, HEAD_DIM])
    v = paddle.randn([batch, seq, case.kv_heads, HEAD_DIM])
    grad_out = paddle.randn([batch, seq, case.q_heads, HEAD_DIM])
    doc_ids = documents(batch, seq, rng) if case.mask == "docs" else None
    mask = dense_mask(case.mask, batch, seq, case.q_heads, rng) if case.mask not in (None, "docs") else None

    full = [t.detach() for t in (q, k, v)]
    for t in full:
        t.stop_gradient = False
    if doc_ids is not None:  # the single card's way to say it: a causal block-diagonal mask
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        ref_mask = paddle.to_tensor((same & np.tri(seq, dtype=bool))[:, None])
        ref = F.scaled_dot_product_attention(*full, attn_mask=ref_mask, scale=scale)
    else:
        ref = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=case.causal, scale=scale)
    ref_grads = paddle.grad([ref], full, [grad_out])

    layout = dict(backend=case.backend, mesh=mesh, ulysses_degree=case.degree)
    local = [pcp.shard_sequence(t, **layout).detach() for t in (q, k, v)]
    for t in local:
        t.stop_gradient = False
    local_mask = None if mask is None else pcp.shard_sequence(mask, seq_dim=2, **layout)
    attention = {"p2p": pcp.ring_attention, "all2all": pcp.ulysses_attention, "hybrid": pcp.hybrid_attention}[case.backend]
    extra = {"ulysses_degree": case.degree} if case.degree else {}
    out = attention(*local, attn_mask=local_mask, is_causal=case.causal, scale=scale, mesh=mesh, seq_len=seq,
                    doc_ids=doc_ids, rotate=case.rotate, **extra)
    full_out = pcp.unshard_sequence(out, seq_len=seq, **layout)
    grads = paddle.grad([full_out], local, [grad_out])
    report.diff(case.name + ".out", full_out, ref)
    for label, got, want in zip("qkv", grads, ref_grads):
        report.diff(f"{case.name}.d{label}", got, pcp.shard_sequence(want, **layout))


def check_skipped_work(report, mesh, world):
    """Causal attention on a batch of 8 packed 256-token documents: query-key pairs computed and skipped
    (the kernel's tiles are 512 keys wide, so a tile is skipped only when no query sees any key in it)."""
    seq, doc = 2048, 256
    doc_ids = np.repeat(np.arange(seq // doc), doc)[None].repeat(2, axis=0)
    q = pcp.shard_sequence(paddle.randn([2, seq, 1, HEAD_DIM]), mesh=mesh)
    pcp.attention_work(reset=True)
    pcp.ring_attention(q, q, q, is_causal=True, mesh=mesh, doc_ids=doc_ids)
    report.value("packed.work", pcp.attention_work(reset=True))
    report.value("packed.masked_fraction", 1 - (seq // doc) * (doc * (doc + 1) // 2) / seq ** 2)
    pcp.ring_attention(q, q, q, is_causal=True, mesh=mesh, seq_len=seq)
    report.value("causal.work", pcp.attention_work(reset=True))


def windowed_reference(q, k, v, window, sinks, scale):
    """One process, as PaddleFormers' eager attention: causal window (i-w < j <= i), a sink logit per head."""
    seq, group = q.shape[1], q.shape[2] // k.shape[2]
    q, k, v = (x.transpose([0, 2, 1, 3]) for x in (q, k, v))  # [b, s, h, d] -> [b, h, s, d]
    k, v = (paddle.repeat_interleave(x, group, axis=1) for x in (k, v))
    scores = paddle.matmul(q, k, transpose_y=True) * scale
    i, j = np.arange(seq)[:, None], np.arange(seq)[None]
    scores = paddle.where(paddle.to_tensor((j <= i) & (j > i - window)), scores, paddle.full([], -1e30))
    sink = sinks.reshape([1, -1, 1, 1]).expand([q.shape[0], -1, seq, 1])
    probs = F.softmax(paddle.concat([scores, sink], axis=-1), axis=-1)[..., :-1]
    return paddle.matmul(probs, v).transpose([0, 2, 1, 3])


def check_window_sinks_mla(report, mesh, world):
    """Sliding window, attention sinks and a v head dim unlike q/k's (MLA) together, per backend."""
    layouts = [("p2p", None), ("all2all", None)] + ([("hybrid", 2)] if world == 4 else [])
    seq, window, scale = 4 * world + 3, 5, 0.3
    for backend, degree in layouts:
        paddle.seed(11)
        full = [paddle.randn([2, seq, 4, HEAD_DIM]), paddle.randn([2, seq, 2, HEAD_DIM]), paddle.randn([2, seq, 2, 6])]
        sinks = paddle.randn([4])
        grad_out = paddle.randn([2, seq, 4, 6])
        for t in [*full, sinks]:
            t.stop_gradient = False
        ref = windowed_reference(*full, window, sinks, scale)
        ref_grads = paddle.grad([ref], [*full, sinks], [grad_out])
        layout = dict(backend=backend, mesh=mesh, ulysses_degree=degree)
        local = [pcp.shard_sequence(t, **layout).detach() for t in full]
        local_sinks = sinks.detach()
        for t in [*local, local_sinks]:
            t.stop_gradient = False
        attention = {"p2p": pcp.ring_attention, "all2all": pcp.ulysses_attention, "hybrid": pcp.hybrid_attention}
        extra = {"ulysses_degree": degree} if degree else {}
        out = attention[backend](*local, is_causal=True, scale=scale, mesh=mesh, seq_len=seq, window=window,
                                 sinks=local_sinks, **extra)
        full_out = pcp.unshard_sequence(out, seq_len=seq, **layout)
        grads = paddle.grad([full_out], [*local, local_sinks], [grad_out])
        name = f"window_sinks_mla.{backend}"
        report.diff(name + ".out", full_out, ref)
        for label, got, want in zip("qkv", grads, ref_grads):
            report.diff(f"{name}.d{label}", got, pcp.shard_sequence(want, **layout))
        dsinks = grads[3].detach().clone()
        if world > 1:
            dist.all_reduce(dsinks)  # each rank's queries hold a part of a sink's gradient
        report.diff(f"{name}.dsinks", dsinks, ref_grads[3])


def check_window_work(report, mesh, world):
    """A 16-token causal window over 512 tokens: pairs computed per rank stay O(seq * window / N)."""
    seq, window = 512, 16
    q = pcp.shard_sequence(paddle.randn([1, seq, 1, HEAD_DIM]), mesh=mesh)
    pcp.attention_work(reset=True)
    pcp.ring_attention(q, q, q, is_causal=True, mesh=mesh, seq_len=seq, window=window)
    report.value("window.work", pcp.attention_work(reset=True))
    pcp.ring_attention(q, q, q, is_causal=True, mesh=mesh, seq_len=seq)
    report.value("window.causal_work", pcp.attention_work(reset=True))
    report.value("window.seq_window", [seq, window])


def check_sdpa_layer(report, mesh, world):
    """Paddle's documented pattern: ContextParallel on a layer that calls F.scaled_dot_product_attention;
    PrepareContextParallel splits the inputs (any length), masks and documents of the top layer."""

    class SDPALayer(paddle.nn.Layer):
        def forward(self, q, k, v, mask):
            return paddle.nn.functional.scaled_dot_product_attention(q, k, v, mask, is_causal=mask is None)

    class Outer(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.sdpa = SDPALayer()

        def forward(self, q, k, v, mask=None):
            return self.sdpa(q, k, v, mask)

    layouts = [("p2p", None), ("all2all", None)] + ([("hybrid", 2)] if world == 4 else [])
    for backend, degree in layouts:
        for docs in (False, True):
            paddle.seed(7)
            seq = 4 * world + 1
            q, k, v = (paddle.randn([2, seq, 2 * world, 8]) for _ in range(3))
            doc_ids = documents(2, seq, np.random.RandomState(3))
            if docs:
                same = doc_ids[:, :, None] == doc_ids[:, None, :]
                ref = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=paddle.to_tensor((same & np.tri(seq, dtype=bool))[:, None]))
            else:
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            prepare = pcp.PrepareContextParallel(backend, degree, documents="doc_ids" if docs else None)
            plan = {"": prepare, "sdpa": pcp.ContextParallel(backend, degree)}
            model, _ = pcp.parallelize(Outer(), mesh=mesh, config={"cp_config": {"parallelize_plan": plan}})
            out = model(q, k, v, doc_ids=paddle.to_tensor(doc_ids)) if docs else model(q, k, v)
            name = f"layer.{backend}{'.docs' if docs else ''}"
            gathered = pcp.unshard_sequence(out, backend=prepare, mesh=mesh, seq_len=seq,
                                            doc_ids=doc_ids if docs else None)  # the batch's documents split it
            report.diff(name + ".out", gathered, ref)
            if not docs:  # a dense mask given to the top layer reaches the attention as this rank's rows
                mask = dense_mask("bool", 2, seq, 2 * world, np.random.RandomState(4))
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                out = pcp.unshard_sequence(model(q, k, v, mask), backend=prepare, mesh=mesh, seq_len=seq)
                report.diff(f"layer.{backend}.dense.out", out, ref)
    mismatched = {"": pcp.PrepareContextParallel("p2p"), "sdpa": pcp.ContextParallel("all2all")}
    report.expect_error("mismatched_plans", lambda: pcp.parallelize(  # at check time, before any collective
        Outer(), mesh=mesh, config={"cp_config": {"parallelize_plan": mismatched}}))
    x = paddle.randn([1, 2 * world, 2 * world, 8])

    class MatmulAttention(paddle.nn.Layer):  # attention no adapter sees: [b, s, h, d] as if heads were batch
        def forward(self, q, k, v, mask=None):
            return paddle.matmul(F.softmax(paddle.matmul(q, k, transpose_y=True), axis=-1), v)

    outer = Outer()
    outer.sdpa = MatmulAttention()
    bypassing = {"": pcp.PrepareContextParallel("p2p"), "sdpa": pcp.ContextParallel("p2p")}
    model, _ = pcp.parallelize(outer, mesh=mesh, config={"cp_config": {"parallelize_plan": bypassing}})
    report.expect_error("bypassed_attention", lambda: model(x, x, x))


def check_unshard_learns_lengths(report, mesh, world):
    """unshard_sequence without seq_len on a length that does not divide (30 tokens on 4 ranks):
    the ranks exchange their lengths instead of waiting on mismatched gathers."""
    seq = 7 * world + 2
    full = paddle.arange(2 * seq * 3, dtype="float32").reshape([2, seq, 3])
    layouts = [("p2p", None), ("all2all", None)] + ([("hybrid", 2)] if world == 4 else [])
    for backend, degree in layouts:
        local = pcp.shard_sequence(full, backend=backend, mesh=mesh, ulysses_degree=degree)
        report.diff(f"unshard.{backend}.no_seq_len",
                    pcp.unshard_sequence(local, backend=backend, mesh=mesh, ulysses_degree=degree), full)
    if world > 1:
        local = pcp.shard_sequence(full, mesh=mesh)
        report.expect_error("unshard_wrong_seq_len", lambda: pcp.unshard_sequence(local, mesh=mesh, seq_len=seq + 1))


def check_functional_learns_lengths(report, mesh, world):
    """The functional attention without seq_len on a length that does not divide (29 tokens on 4
    ranks): the ranks agree on the length; shards that are not the layout fail alike everywhere."""
    seq = 7 * world + 1  # uneven local lengths at every world > 1
    paddle.seed(5)
    q, k, v = (paddle.randn([1, seq, 4, HEAD_DIM]) for _ in range(3))  # 4 heads: Ulysses over up to 4 ranks
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    attention = {"p2p": pcp.ring_attention, "all2all": pcp.ulysses_attention, "hybrid": pcp.hybrid_attention}
    for backend, degree in [("p2p", None), ("all2all", None)] + ([("hybrid", 2)] if world == 4 else []):
        layout = dict(backend=backend, mesh=mesh, ulysses_degree=degree)
        local = [pcp.shard_sequence(t, **layout) for t in (q, k, v)]
        out = attention[backend](*local, is_causal=True, mesh=mesh, ulysses_degree=degree)
        report.diff(f"attention.{backend}.no_seq_len.out", pcp.unshard_sequence(out, **layout), ref)
    if world > 1:
        # rank 0 holds 3N tokens, the others one each: no layout splits a sequence so
        lopsided = q[:, :3 * world] if dist.get_rank() == 0 else q[:, :1]
        report.expect_error("shards_not_layout", lambda: pcp.ring_attention(lopsided, lopsided, lopsided, mesh=mesh))


def check_rank_dependent_gradients(report, mesh, world):
    """A layer only rank 0 uses has a gradient there alone: the optimizer still reduces buffers of one
    size on every rank (no rank waits), and every rank steps it by rank 0's gradient / world."""
    paddle.seed(11)
    used, branch = paddle.nn.Linear(3, 3), paddle.nn.Linear(3, 3)
    model = paddle.nn.LayerList([used, branch])
    start = branch.weight.numpy().copy()
    optimizer = paddle.optimizer.SGD(learning_rate=1.0, parameters=model.parameters())
    _, optimizer = pcp.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    x = paddle.ones([2, 3])
    out = used(x)
    if dist.get_rank() == 0:
        out = branch(out)
    out.sum().backward()
    expected = paddle.to_tensor(start - branch.weight.grad.numpy() / world) if dist.get_rank() == 0 else paddle.zeros([3, 3])
    optimizer.step()
    if world > 1:
        dist.broadcast(expected, src=0)
    report.diff("branch.weight", branch.weight, expected)


def _planned_against_allgather(report, name, attend, layout, seq, shape, causal, documents=None, window=None,
                               valid=None):
    """`attend(rotate)` -> [output, gradients...] with rotate='planned' and 'allgather' (whole blocks, the gradients
    summed by one reduce-scatter, in another order), and the ring bytes the planned exchange sent against
    exchange_plan's count for this rank. `shape`: (batch, q heads, kv heads, v head dim) of the fp32 inputs
    (gradients fp32 too)."""
    results, sent = {}, {}
    for rotate in ("allgather", "planned"):
        before = pcp.bytes_sent().get("ring", 0)
        results[rotate] = [t.numpy() for t in attend(rotate)]
        sent[rotate] = pcp.bytes_sent().get("ring", 0) - before
    batch, q_heads, kv_heads, v_dim = shape
    rank = dist.get_rank()
    local_kv_heads = head_split(q_heads, kv_heads, layout.ulysses).kv_counts[rank % layout.ulysses]
    row_bytes = batch * local_kv_heads * (HEAD_DIM + v_dim) * 4
    plan = ExchangePlan(layout.ring_positions(seq), causal, documents, window, valid)
    counted = exchange_bytes(plan, row_bytes, row_bytes)
    member = rank // layout.ulysses
    pairs = list(zip(results["allgather"], results["planned"]))
    report.value(f"planned.{name}", {
        "max_rel_diff": max(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)) for a, b in pairs),
        "compared": len(pairs), "planned_bytes": sent["planned"],
        "whole_block_bytes": int(counted.whole_blocks[member]),
        "planned": int(counted.planned[member]), "read": int(counted.read[member])})


def check_planned_exchange(report, mesh, world):
    """rotate='planned' against 'allgather' on the same layouts and inputs, every backend with a ring: the functional
    cases (causal, full, documents, dense boolean and additive masks, uneven lengths and heads), a window with
    sinks and MLA, packed documents in the documents layout, padding keys."""
    for case in cases(world):
        if case.backend == "all2all":
            continue
        paddle.seed(1234)
        rng = np.random.RandomState(5)
        q, k, v, grad_out = (paddle.randn([case.batch, case.seq, h, HEAD_DIM])
                             for h in (case.q_heads, case.kv_heads, case.kv_heads, case.q_heads))
        doc_ids = documents(case.batch, case.seq, rng) if case.mask == "docs" else None
        mask = dense_mask(case.mask, case.batch, case.seq, case.q_heads, rng) if case.mask not in (None, "docs") else None
        layout = dict(backend=case.backend, mesh=mesh, ulysses_degree=case.degree)
        local_mask = None if mask is None else pcp.shard_sequence(mask, seq_dim=2, **layout)
        attention = {"p2p": pcp.ring_attention, "hybrid": pcp.hybrid_attention}[case.backend]
        extra = {"ulysses_degree": case.degree} if case.degree else {}

        def attend(rotate, case=case, doc_ids=doc_ids, local_mask=local_mask, layout=layout, attention=attention,
                extra=extra, inputs=(q, k, v, grad_out)):
            local = [pcp.shard_sequence(t, **layout).detach() for t in inputs[:3]]
            for t in local:
                t.stop_gradient = False
            out = attention(*local, attn_mask=local_mask, is_causal=case.causal, scale=case.scale, mesh=mesh,
                            seq_len=case.seq, doc_ids=doc_ids, rotate=rotate, **extra)
            return [out, *paddle.grad([out], local, [pcp.shard_sequence(inputs[3], **layout)])]
        docs = None if doc_ids is None else Documents.from_ids(doc_ids)
        _planned_against_allgather(report, case.name, attend, SequenceLayout(case.backend, world, case.degree),
                                   case.seq, (case.batch, case.q_heads, case.kv_heads, HEAD_DIM), case.causal, docs)

    for backend, degree in [("p2p", None)] + ([("hybrid", 2)] if world == 4 else []):
        layout = SequenceLayout(backend, world, degree)
        groups = resolve_groups(layout, mesh)
        paddle.seed(11)
        seq, window = 8 * world + 3, 5
        inputs = [paddle.randn([2, seq, 4, HEAD_DIM]), paddle.randn([2, seq, 2, HEAD_DIM]),
                  paddle.randn([2, seq, 2, 6]), paddle.randn([2, seq, 4, 6])]
        sinks = paddle.randn([4])

        def windowed(rotate, layout=layout, groups=groups, inputs=inputs, sinks=sinks, seq=seq, window=window):
            local = [layout.shard(t, 1, groups.sep.index).detach() for t in inputs] + [sinks.detach()]
            for t in local[:3] + local[4:]:
                t.stop_gradient = False
            out = context_parallel_attention(layout, groups, *local[:3], is_causal=True, seq_len=seq, window=window,
                                             sinks=local[4], rotate=rotate)
            return [out, *paddle.grad([out], local[:3] + local[4:], [local[3]])]
        _planned_against_allgather(report, f"window_sinks_mla.{backend}", windowed, layout, seq, (2, 4, 2, 6), True,
                              window=window)

        paddle.seed(12)
        seq = 64 * world + 5
        valid = np.ones([2, seq], bool)
        valid[0, seq // 2:], valid[1, :seq // 3] = False, False  # right padding in one row, left in the other
        inputs = [paddle.randn([2, seq, h, HEAD_DIM]) for h in (2, 2, 2, 2)]

        def padded(rotate, layout=layout, groups=groups, inputs=inputs, seq=seq, valid=valid):
            local = [layout.shard(t, 1, groups.sep.index).detach() for t in inputs]
            for t in local[:3]:
                t.stop_gradient = False
            out = context_parallel_attention(layout, groups, *local[:3], is_causal=True, seq_len=seq, valid=valid,
                                             rotate=rotate)
            return [out, *paddle.grad([out], local[:3], [local[3]])]
        _planned_against_allgather(report, f"padding.{backend}", padded, layout, seq, (2, 2, 2, HEAD_DIM), True,
                              valid=valid)

        if world > 1:  # packed documents in the layout chosen for them (most documents whole on one rank)
            seq = 1024
            position_ids = packing.packed_position_ids(np.array([100, 300, 50, 200, 90, 150, 134]), seq, 1)
            docs = Documents.from_position_ids(position_ids)
            chosen = layout.for_batch(docs)
            inputs = [paddle.randn([1, seq, 2, HEAD_DIM]) for _ in range(4)]

            def packed(rotate, layout=chosen, groups=groups, inputs=inputs, seq=seq, docs=docs):
                local = [layout.shard(t, 1, groups.sep.index).detach() for t in inputs]
                for t in local[:3]:
                    t.stop_gradient = False
                out = context_parallel_attention(layout, groups, *local[:3], is_causal=True, seq_len=seq,
                                                 documents=docs, rotate=rotate)
                return [out, *paddle.grad([out], local[:3], [local[3]])]
            _planned_against_allgather(report, f"packed.{backend}.{chosen.split.name}", packed, chosen, seq,
                                  (1, 2, 2, HEAD_DIM), True, docs)


# fleet.utils.recompute's use_reentrant; "refetch": reentrant, the received k/v over the limit a replay holds
RECOMPUTE_MODES = {"none": None, "reentrant": True, "plain": False, "refetch": True}


def check_recompute_exchange(report, mesh, world):
    """Ring attention under fleet.utils.recompute (reentrant and not) against the same call without: its backward
    reads the k/v rows the replay received instead of fetching them again, so each rank sends the ring bytes and
    makes the ring calls the call without recomputation makes (the exchange plan's 3 x rows read, planned),
    with bit for bit the same output and gradients, within 1e-5 of one process's SDPA. Past
    exchange.REPLAY_HOLD_LIMIT (lowered to 0 here) the backward fetches them again: 4 x."""
    cases = [("p2p.causal", "p2p", None, "planned", False), ("p2p.causal.allgather", "p2p", None, "allgather", False),
             ("p2p.docs", "p2p", None, "planned", True)]
    if world == 4:
        cases.append(("hybrid.docs", "hybrid", 2, "planned", True))
    for name, backend, degree, rotate, with_docs in cases:
        paddle.seed(21)
        batch, seq, heads, kv_heads = 2, 16 * world + 3, 4, 2
        q, k, v, grad_out = (paddle.randn([batch, seq, h, HEAD_DIM]) for h in (heads, kv_heads, kv_heads, heads))
        doc_ids = documents(batch, seq, np.random.RandomState(9)) if with_docs else None
        full = [t.detach() for t in (q, k, v)]
        for t in full:
            t.stop_gradient = False
        ref_mask = None if doc_ids is None else paddle.to_tensor(
            ((doc_ids[:, :, None] == doc_ids[:, None, :]) & np.tri(seq, dtype=bool))[:, None])
        ref = F.scaled_dot_product_attention(*full, attn_mask=ref_mask, is_causal=doc_ids is None)
        ref_grads = paddle.grad([ref], full, [grad_out])
        layout = dict(backend=backend, mesh=mesh, ulysses_degree=degree)
        attention = {"p2p": pcp.ring_attention, "hybrid": pcp.hybrid_attention}[backend]
        extra = {"ulysses_degree": degree} if degree else {}
        local_grad_out = pcp.shard_sequence(grad_out, **layout)

        def attend(attention=attention, seq=seq, doc_ids=doc_ids, rotate=rotate, extra=extra):
            def call(q, k, v):  # positional only: reentrant recompute takes no keyword-only arguments
                return attention(q, k, v, is_causal=True, mesh=mesh, seq_len=seq, doc_ids=doc_ids, rotate=rotate,
                                 **extra)
            return call
        call = attend()

        sent, results = {}, {}
        for mode, reentrant in RECOMPUTE_MODES.items():
            local = [pcp.shard_sequence(t, **layout).detach() for t in (q, k, v)]
            for t in local:
                t.stop_gradient = False
            bytes_before, calls_before = counters.bytes_sent("ring"), counters.collectives_issued("ring")
            limit, cost_exchange.REPLAY_HOLD_LIMIT = cost_exchange.REPLAY_HOLD_LIMIT, (
                0 if mode == "refetch" else cost_exchange.REPLAY_HOLD_LIMIT)
            out = call(*local) if reentrant is None else recompute(call, *local, use_reentrant=reentrant)
            (out * local_grad_out).sum().backward()
            cost_exchange.REPLAY_HOLD_LIMIT = limit
            sent[mode] = {"bytes": counters.bytes_sent("ring") - bytes_before,
                          "calls": counters.collectives_issued("ring") - calls_before}
            results[mode] = [out.numpy()] + [t.grad.numpy() for t in local]
            report.diff(f"recompute.{name}.{mode}.out", pcp.unshard_sequence(out, seq_len=seq, **layout), ref)
            for label, t, want in zip("qkv", local, ref_grads):
                report.diff(f"recompute.{name}.{mode}.d{label}", t.grad, pcp.shard_sequence(want, **layout))
        sequence_layout = SequenceLayout(backend, world, degree)
        rank = dist.get_rank()
        local_kv_heads = head_split(heads, kv_heads, sequence_layout.ulysses).kv_counts[rank % sequence_layout.ulysses]
        plan = ExchangePlan(sequence_layout.ring_positions(seq), True,
                            None if doc_ids is None else Documents.from_ids(doc_ids))
        counted = exchange_bytes(plan, batch * local_kv_heads * 2 * HEAD_DIM * 4, batch * local_kv_heads * 2 * HEAD_DIM * 4)
        report.value(f"recompute.{name}", {
            "sent": sent, "ring": plan.ring, "rotate": rotate,
            "planned": int(counted.planned[rank // sequence_layout.ulysses]),
            "read": int(counted.read[rank // sequence_layout.ulysses]),
            "bitwise": {mode: all(np.array_equal(a, b) for a, b in zip(results["none"], got))
                        for mode, got in results.items()}})


def check_errors(report, mesh, world):
    x = paddle.randn([1, 2 * world, 2 * world, 8])
    report.expect_error("unknown_backend", lambda: pcp.PrepareContextParallel("ring"))
    report.expect_error("context_backend", lambda: pcp.ContextParallel("alltoall"))
    report.expect_error("hybrid_without_degree", lambda: pcp.ContextParallel("hybrid"))
    report.expect_error("degree_without_hybrid", lambda: pcp.PrepareContextParallel("p2p", ulysses_degree=2))
    report.expect_error("unknown_rotation", lambda: pcp.ContextParallel("p2p", rotate="shuffle"))
    no_sep = dist.ProcessMesh(list(range(world)), dim_names=["dp"])
    report.expect_error("mesh_without_sep", lambda: pcp.ring_attention(x, x, x, mesh=no_sep))
    report.expect_error("dropout", lambda: pcp.ring_attention(x, x, x, dropout_p=0.1, mesh=mesh))
    report.expect_error("shapes", lambda: pcp.ring_attention(x, x[:, :, :1, :4], x, mesh=mesh))
    report.expect_error("mask_shape", lambda: pcp.ring_attention(
        x, x, x, attn_mask=paddle.ones([1, 1, 2 * world, 2 * world + 1], "bool"), mesh=mesh))
    if world > 1:
        short = paddle.randn([1, world - 1, 2, 8])
        report.expect_error("short_sequence", lambda: pcp.shard_sequence(short, mesh=mesh))
        few_heads = paddle.randn([1, 2, world - 1, 8])
        report.expect_error("ulysses_heads", lambda: pcp.ulysses_attention(few_heads, few_heads, few_heads, mesh=mesh))
        # a length that gives every rank 2 more tokens than it holds: all ranks refuse, none waits
        report.expect_error("wrong_seq_len", lambda: pcp.ring_attention(x, x, x, mesh=mesh, seq_len=2 * world * world + 2 * world))
    if world == 4:
        report.expect_error("degree_not_dividing", lambda: pcp.hybrid_attention(x, x, x, mesh=mesh, ulysses_degree=3))


def main(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    for case in cases(world):
        check_case(report, mesh, case)
    check_skipped_work(report, mesh, world)
    check_window_sinks_mla(report, mesh, world)
    check_window_work(report, mesh, world)
    check_sdpa_layer(report, mesh, world)
    check_unshard_learns_lengths(report, mesh, world)
    check_functional_learns_lengths(report, mesh, world)
    check_rank_dependent_gradients(report, mesh, world)
    check_planned_exchange(report, mesh, world)
    check_recompute_exchange(report, mesh, world)
    check_errors(report, mesh, world)
    report.value("bytes", pcp.bytes_sent())


run(main)
