"""A training step of a model with tiny heads on one packed row of short documents, under the layout a
PrepareContextParallel plan gives the batch by default and under 2N chunks: what a step plans and runs.

Per layout: whether it moved tokens from the 2N chunks, the attention masks made per step (BlockMasks: once per batch, not per layer
or direction), the blockwise kernel's calls per step (one per ring step, layer and direction), the query-key
pairs it computes, and the median step time, wall and this rank's CPU (for the note, never asserted). argv:
seq_len, the document lengths' median (lognormal, tools/packing.py), the row of the packed stream, timed steps.
"""
import statistics
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist
from real_model_parity import adamw
from report import run

import paddle_cp as pcp
from paddle_cp.attention import kernels
from paddle_cp.attention.masks import block_mask
from paddle_cp.tools import packing

LAYERS, VOCAB = 2, 64
_counts = {"masks": 0, "kernel_calls": 0}


def _counted():
    """Count BlockMasks made and blockwise kernel calls (forward and backward)."""
    made = block_mask.BlockMask.__init__

    def init(self, *args, **kwargs):
        _counts["masks"] += 1
        made(self, *args, **kwargs)

    block_mask.BlockMask.__init__ = init
    for method in ("forward", "backward"):
        original = getattr(kernels.BlockwiseKernel, method)
        setattr(kernels.BlockwiseKernel, method, lambda self, *args, original=original: _counts.__setitem__(
            "kernel_calls", _counts["kernel_calls"] + 1) or original(self, *args))


def llama():
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(2024)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
                         num_attention_heads=2, num_key_value_heads=1, fuse_rms_norm=False)
    return LlamaForCausalLM(config)


def train(report, mesh, layout, seq, positions, steps):
    prepare = pcp.PrepareContextParallel("p2p", documents="position_ids", layout=layout)
    plan = {"model": prepare, "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    model = llama()
    model, opt = pcp.parallelize(model, adamw(model), mesh, {"cp_config": {"parallelize_plan": plan}})
    rng = np.random.RandomState(5)
    seconds, cpu, counts = [], [], []
    for _ in range(steps + 1):  # the first step warms up
        ids = rng.randint(0, VOCAB, [1, seq + 1])
        ids, labels = paddle.to_tensor(ids[:, :-1]), paddle.to_tensor(ids[:, 1:])
        dist.barrier()
        before = dict(_counts)
        pcp.attention_work(reset=True)
        start, start_cpu = time.perf_counter(), time.process_time()
        local = pcp.shard_sequence(labels, backend=prepare, mesh=mesh, position_ids=positions)
        loss = model(input_ids=ids, labels=local, position_ids=positions)[0] * pcp.loss_weight(local.numel(), mesh)
        loss.backward()
        opt.step()
        opt.clear_grad()
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        work = pcp.attention_work(reset=True)
        counts.append({key: _counts[key] - before[key] for key in _counts} | {"computed": work["computed"]})
    mine = pcp.sequence_positions(seq, backend=prepare, mesh=mesh, position_ids=positions)
    chunks = pcp.sequence_positions(seq, backend="p2p", mesh=mesh)
    report.value(f"{layout}.moved", not np.array_equal(mine.numpy(), chunks.numpy()))
    report.value(f"{layout}.counts", counts[1:])
    report.value(f"{layout}.step_seconds", statistics.median(seconds[1:]))
    report.value(f"{layout}.step_cpu_seconds", statistics.median(cpu[1:]))


def main(report):
    seq, median, row, steps = (int(arg) for arg in sys.argv[1:5])
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["sep"])
    lengths = packing.lognormal_lengths(median=median)
    positions = paddle.to_tensor(packing.packed_position_ids(lengths, seq, row + 1)[row:])
    report.value("documents", int((positions.numpy() == 0).sum()))
    report.value("layers", LAYERS)
    _counted()
    for layout in ("documents", "chunks"):
        train(report, mesh, layout, seq, positions, steps)


run(main)
