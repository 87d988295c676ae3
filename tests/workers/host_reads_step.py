"""Host reads in a steady-state training step under paddle_cp, layout by layout (4 ranks).

Each layout trains PaddleFormers' Llama (4 layers, untied; Qwen3-MoE for the experts group) for STEPS
AdamW steps from one seed on the same global batches; steps 3 to 5 (forward, backward, optimizer.step(),
clear_grad()) run under paddle_cp.tools.host_reads.counting(). Batches are made (and split with pcp.shard_batch /
shard_sequence) before the count: that is the data loader's work. Reported per layout: the counts
(reads, uploads, deferred reads, and the line of each) and the losses (every step, this rank), so the
run is seen to train. argv[1] names the group of layouts.
"""
import contextlib
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from pipeline import EPSILON, CLIP, llama
from report import run

import paddle_cp as pcp
from paddle_cp.tools import host_reads
from tensor_parallel import sequence_parallel_plan

BATCH, SEQ, STEPS, COUNTED = 4, 16, 5, range(2, 5)  # steps 3-5
VOCAB = 64
BASE = {"split_spec": "model.layers", "global_spec": "model.rotary_emb"}


def cp_plan(backend, degree=None):
    return {"": pcp.PrepareContextParallel(backend, degree),
            "model.layers.*.self_attn": pcp.ContextParallel(backend, degree)}


def mesh_of(dims):
    shape = [size for _, size in dims]
    return dist.ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape).tolist(), dim_names=[n for n, _ in dims])


def layouts():
    """name -> (mesh dims, parallelize config)."""
    cp = {"cp_config": {"parallelize_plan": cp_plan("p2p")}}
    dense = {
        "ring": ([("sep", 4)], cp),
        "ulysses": ([("sep", 4)], {"cp_config": {"parallelize_plan": cp_plan("all2all")}}),
        "hybrid": ([("sep", 4)], {"cp_config": {"parallelize_plan": cp_plan("hybrid", 2)}}),
        "tp_sp.dp2": ([("dp", 2), ("mp", 2)], {"mp_config": {"parallelize_plan": sequence_parallel_plan()}}),
        "tp_sp.sep2": ([("sep", 2), ("mp", 2)], {**cp, "mp_config": {"parallelize_plan": sequence_parallel_plan()}}),
    }
    sharding = {f"sharding{level}.dp2_sep2": ([("dp", 2), ("sep", 2)], {**cp, "dp_config": {"sharding_level": level}})
                for level in (1, 2, 3)}
    pipelines = {
        "pp2_sep2.1f1b": ([("pp", 2), ("sep", 2)], {**cp, "pp_config": {**BASE, "schedule_mode": "1F1B",
                                                                         "accumulate_steps": 2}}),
        "pp2_sep2.vpp": ([("pp", 2), ("sep", 2)], {**cp, "pp_config": {**BASE, "schedule_mode": "VPP",
                                                                        "vpp_degree": 2, "accumulate_steps": 2}}),
        "pp2_dp2.fthenb": ([("dp", 2), ("pp", 2)], {"pp_config": {**BASE, "schedule_mode": "FThenB",
                                                                  "accumulate_steps": 2}}),
        "pp4.1f1b": ([("pp", 4)], {"pp_config": {**BASE, "schedule_mode": "1F1B", "accumulate_steps": 4}}),
    }
    experts = {"qwen3_moe.dp2_sep2": ([("dp", 2), ("sep", 2)], {**cp, "ep_config": {
        "degree": 4, "parallelize_plan": {"model.layers.*.mlp": pcp.ExpertParallel()}}})}
    return {"dense": dense, "sharding": sharding, "pipelines": pipelines, "experts": experts}


def qwen3_moe():
    """PaddleFormers' Qwen3-MoE, small (tests/workers/paddleformers_models.py): every layer an MoE layer."""
    from paddleformers_models import build as build_family
    from paddleformers_models import stub_gpu_modules

    stub_gpu_modules()
    return build_family("qwen3_moe", dtype="float32")


MODELS = {"experts": qwen3_moe}


def batches():
    rng = np.random.RandomState(7)
    return [(paddle.to_tensor(rng.randint(0, VOCAB, [BATCH, SEQ]), dtype="int64"),
             paddle.to_tensor(rng.randint(0, VOCAB, [BATCH, SEQ]), dtype="int64")) for _ in range(STEPS)]


def build(group):
    paddle.seed(2024)
    model = MODELS.get(group, lambda: llama(tie=False))()
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-2, weight_decay=0.1, epsilon=EPSILON,
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP), parameters=model.parameters())
    return model, optimizer


def local_batch(ids, labels, mesh, config):
    """This rank's inputs (the data loader's work): its dp replica's rows; labels split like the inputs."""
    if "dp" in mesh.dim_names:
        ids, labels = pcp.shard_batch((ids, labels), mesh=mesh)
    if "cp_config" in config and "pp_config" not in config:
        labels = pcp.shard_sequence(labels, backend=config["cp_config"]["parallelize_plan"][""], mesh=mesh)
    return ids, labels


def train_counting(group, dims, config):
    """(losses, host reads of the counted steps) of one layout."""
    mesh = mesh_of(dims)
    model, optimizer = build(group)
    model, optimizer = pcp.parallelize(model, optimizer, mesh, config)
    counts, losses = host_reads.HostReads(), []
    for step, (ids, labels) in enumerate(batches()):
        ids, labels = local_batch(ids, labels, mesh, config)
        with host_reads.counting(counts) if step in COUNTED else contextlib.nullcontext():
            loss = model(ids, labels=labels)[0]
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
        losses.append(float(loss))
    return losses, counts


def main(report):
    for group in sys.argv[1:]:  # each a group of layouts()
        report.value(f"{group}.layouts", sorted(layouts()[group]))
        for name, (dims, config) in layouts()[group].items():
            losses, counts = train_counting(group, dims, config)
            report.value(f"{name}.losses", losses)
            report.value(f"{name}.counts", counts.as_dict())


run(main)
