"""Device-to-host reads during one context-parallel attention call (forward and backward).

Every Tensor method that hands a value to the host is counted while the call runs
(paddle_cp/tools/host_reads.py; copies in, paddle.to_tensor of host data, apart), and so are the
blocks (one ring step's query-key pairs, forward and backward) the call builds. Tile decisions for causal,
full, windowed and document masks come from host-side positions: those calls read nothing;
a dense mask may be read once per block.
"""
import contextlib

import numpy as np
import paddle
import paddle.distributed as dist
from report import run

import paddle_cp as pcp
from paddle_cp.attention.algorithms.ring import RingMasks
from paddle_cp.tools import host_reads

TILE = 512  # the blockwise kernel's tile: lengths above it give several tiles per block


@contextlib.contextmanager
def counting(counts):
    """Host reads (paddle_cp.tools.host_reads) and blocks built while the block runs, into `counts`."""
    original = RingMasks.block

    def block(*args, **kwargs):
        counts["blocks"] = counts.get("blocks", 0) + 1
        return original(*args, **kwargs)

    RingMasks.block = block
    try:
        with host_reads.counting() as reads:
            yield
    finally:
        RingMasks.block = original
        counts["reads"], counts["uploads"] = reads.reads, reads.uploads


def main(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    seq = TILE * world + 1  # uneven, and more than one tile per block
    rng = np.random.RandomState(0)
    doc_ids = np.searchsorted(np.sort(rng.choice(np.arange(1, seq), 5, replace=False)), np.arange(seq),
                              side="right")[None]
    dense = paddle.to_tensor(rng.rand(1, 1, seq, seq) < 0.7)
    cases = {"causal": dict(is_causal=True), "full": dict(is_causal=False),
             "documents": dict(is_causal=True, doc_ids=doc_ids), "documents.full": dict(doc_ids=doc_ids),
             "window": dict(is_causal=True, window=TILE // 3),
             "dense": dict(attn_mask="dense")}
    for backend, attention in (("p2p", pcp.ring_attention), ("all2all", pcp.ulysses_attention)):
        prepare = pcp.PrepareContextParallel(backend)
        for name, kwargs in cases.items():
            paddle.seed(1)
            q, k, v = (pcp.shard_sequence(paddle.randn([1, seq, 2, 8]), backend=prepare, mesh=mesh)
                       for _ in range(3))
            for t in (q, k, v):
                t.stop_gradient = False
            if kwargs.get("attn_mask") == "dense":
                kwargs = dict(attn_mask=pcp.shard_sequence(dense, seq_dim=2, backend=prepare, mesh=mesh))
            counts = {}
            with counting(counts):
                out = attention(q, k, v, mesh=mesh, seq_len=seq, **kwargs)
                out.sum().backward()
            report.value(f"{backend}.{name}", counts)


run(main)
