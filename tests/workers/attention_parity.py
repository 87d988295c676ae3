"""Context-parallel attention vs one process's F.scaled_dot_product_attention.

Every rank computes the single-process reference from the same seed, runs the
context-parallel version on its shard, gathers the output and compares output
and q/k/v gradients.
"""
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from report import run

import paddle_cp as pcp

CASES = [  # (backend, causal, batch, seq_per_2N_chunk, q_heads, kv_heads, head_dim)
    ("p2p", True, 2, 3, 4, 2, 8),
    ("p2p", False, 1, 2, 4, 4, 16),
    ("p2p", True, 1, 5, 4, 1, 8),
    ("all2all", True, 2, 3, 0, 0, 8),
    ("all2all", False, 1, 2, 0, 0, 16),
]


def check_case(report, mesh, world, backend, causal, batch, chunk, q_heads, kv_heads, head_dim):
    # Ulysses needs heads divisible by N: use 2N query heads and N k/v heads (GQA) or 1 when N = 1.
    if backend == "all2all":
        q_heads, kv_heads = 2 * world, max(world // 2, 1) if world % 2 == 0 else world
    seq = 2 * world * chunk
    paddle.seed(1234)
    q = paddle.randn([batch, seq, q_heads, head_dim])
    k = paddle.randn([batch, seq, kv_heads, head_dim])
    v = paddle.randn([batch, seq, kv_heads, head_dim])
    grad_out = paddle.randn([batch, seq, q_heads, head_dim])
    full = [t.detach() for t in (q, k, v)]
    for t in full:
        t.stop_gradient = False
    ref = F.scaled_dot_product_attention(*full, is_causal=causal)
    ref_grads = paddle.grad([ref], full, [grad_out])

    local = [pcp.shard_sequence(t, backend=backend, mesh=mesh).detach() for t in (q, k, v)]
    for t in local:
        t.stop_gradient = False
    attention = pcp.ring_attention if backend == "p2p" else pcp.ulysses_attention
    out = attention(*local, is_causal=causal, mesh=mesh)
    full_out = pcp.unshard_sequence(out, backend=backend, mesh=mesh)
    grads = paddle.grad([full_out], local, [grad_out])
    name = f"{backend}.{'causal' if causal else 'full'}.b{batch}s{seq}h{q_heads}/{kv_heads}"
    report.diff(name + ".out", full_out, ref)
    for label, got, want in zip("qkv", grads, ref_grads):
        report.diff(f"{name}.d{label}", got, pcp.shard_sequence(want, backend=backend, mesh=mesh))


def check_sdpa_layer(report, mesh, world):
    """Paddle's documented pattern: ContextParallel on a layer that calls F.scaled_dot_product_attention."""

    class SDPALayer(paddle.nn.Layer):
        def forward(self, q, k, v):
            return paddle.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    class Outer(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.sdpa = SDPALayer()

        def forward(self, q, k, v):
            return self.sdpa(q, k, v)

    for backend in ("p2p", "all2all"):
        paddle.seed(7)
        seq = 4 * world
        q, k, v = (paddle.randn([2, seq, 2 * world, 8]) for _ in range(3))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        model = Outer()
        plan = {"": pcp.PrepareContextParallel(backend), "sdpa": pcp.ContextParallel(backend)}
        model, _ = pcp.parallelize(model, mesh=mesh, config={"cp_config": {"parallelize_plan": plan}})
        out = model(q, k, v)
        report.diff(f"layer.{backend}.out", pcp.unshard_sequence(out, backend=backend, mesh=mesh), ref)
        report.value(f"layer.{backend}.sdpa_restored",
                     paddle.nn.functional.scaled_dot_product_attention is F.scaled_dot_product_attention)


def check_errors(report, mesh, world):
    x = paddle.randn([1, 2 * world, 2 * world, 8])
    report.expect_error("unknown_backend", lambda: pcp.PrepareContextParallel("ring"))
    report.expect_error("context_backend", lambda: pcp.ContextParallel("alltoall"))
    no_sep = dist.ProcessMesh(list(range(world)), dim_names=["dp"])
    report.expect_error("mesh_without_sep", lambda: pcp.ring_attention(x, x, x, mesh=no_sep))
    odd = paddle.randn([1, 2 * world + 1, 2, 8])
    report.expect_error("p2p_length", lambda: pcp.shard_sequence(odd, mesh=mesh))
    report.expect_error("dropout", lambda: pcp.ring_attention(x, x, x, dropout_p=0.1, mesh=mesh))
    report.expect_error("shapes", lambda: pcp.ring_attention(x, x[:, :, :1, :4], x, mesh=mesh))
    if world > 1:
        heads = paddle.randn([1, 2 * world, world + 1, 8])
        report.expect_error("ulysses_heads", lambda: pcp.ulysses_attention(heads, heads, heads, mesh=mesh))
        ragged = paddle.randn([1, world + 1, 2, 8])
        report.expect_error("all2all_length", lambda: pcp.shard_sequence(ragged, backend="all2all", mesh=mesh))


def main(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    for case in CASES:
        check_case(report, mesh, world, *case)
    check_sdpa_layer(report, mesh, world)
    check_errors(report, mesh, world)
    report.value("bytes", pcp.bytes_sent())


run(main)
