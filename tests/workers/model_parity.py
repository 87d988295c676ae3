"""Three AdamW steps of a Llama under parallelize(cp_config) vs one process on the same batch.

argv: model sources (tiny and/or paddleformers). Both plan styles are exercised:
the project's tiny model puts PrepareContextParallel on the root (key "", it
splits labels too); PaddleFormers' Llama puts it on `model`, as Paddle's docs
do, and its labels are split by hand with pcp.shard_sequence.
"""
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from llama_models import build_llama, loss_of
from report import run

import paddle_cp as pcp

STEPS = 3


def adamw(model):
    # AdamW divides each gradient by its own magnitude (+ epsilon): an element
    # whose gradient is ~1e-8 would turn fp32 rounding into a whole-lr step.
    # epsilon=1e-5 bounds that amplification below the 1e-5 parameter budget.
    return paddle.optimizer.AdamW(learning_rate=1e-3, epsilon=1e-5, parameters=model.parameters())


def make_batch(seq):
    paddle.seed(99)
    ids = paddle.randint(0, 128, [2, seq + 1])
    return ids[:, :-1], ids[:, 1:]


def reference(source, seq):
    paddle.seed(2024)
    model = build_llama(source)
    opt = adamw(model)
    ids, labels = make_batch(seq)
    losses, grads = [], None
    for step in range(STEPS):
        loss = loss_of(model(input_ids=ids, labels=labels))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, grads, {n: p.numpy() for n, p in model.named_parameters()}


def parallel(source, seq, backend, mesh):
    paddle.seed(2024)
    model = build_llama(source)
    opt = adamw(model)
    if source == "tiny":
        plan = {"": pcp.PrepareContextParallel(backend), "model.layers.*.self_attn": pcp.ContextParallel(backend)}
    else:
        plan = {"model": pcp.PrepareContextParallel(backend), "model.layers.*.self_attn": pcp.ContextParallel(backend)}
    model, opt = pcp.parallelize(model, opt, mesh, {"cp_config": {"parallelize_plan": plan}})
    ids, labels = make_batch(seq)
    if source != "tiny":
        labels = pcp.shard_sequence(labels, backend=backend, mesh=mesh)
    world = mesh.shape[mesh.dim_names.index("sep")]
    losses, grads = [], None
    for step in range(STEPS):
        loss = loss_of(model(input_ids=ids, labels=labels))
        loss.backward()
        opt.step()  # averages gradients over sep first
        if step == 0:
            grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        opt.clear_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses, grads, {n: p.numpy() for n, p in model.named_parameters()}


def main(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    seq = 8 * world
    for source in sys.argv[1:]:
        ref_losses, ref_grads, ref_params = reference(source, seq)
        report.value(f"{source}.ref_losses", ref_losses)
        for backend in ("p2p", "all2all"):
            name = f"{source}.{backend}"
            losses, grads, params = parallel(source, seq, backend, mesh)
            report.value(f"{name}.losses", losses)
            report.diff(f"{name}.loss", np.array(losses), np.array(ref_losses))
            for param, value in ref_grads.items():
                report.diff(f"{name}.grad", grads[param], value)
            for param, value in ref_params.items():
                report.diff(f"{name}.param", params[param], value)


run(main)
