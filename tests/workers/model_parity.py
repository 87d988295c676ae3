"""Three AdamW steps of a Llama under parallelize(cp_config) vs one process on the same batch.

argv: model sources (tiny and/or paddleformers). Runs cover every backend,
lengths that do not divide (losses weighted by pcp.loss_weight), both k/v
rotations, and packed documents given as restarting position ids or as a
dense [b, 1, s, s] mask. The single card sees packed documents as a dense
causal block-diagonal mask. Plan styles: the tiny model puts
PrepareContextParallel on the root (key "", it splits labels too);
PaddleFormers' Llama puts it on `model`, as Paddle's docs do, and its labels
are split by hand with pcp.shard_sequence.
"""
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from batches import make_batch
from llama_models import build_llama, loss_of
from report import run

import paddle_cp as pcp

STEPS = 3


def runs(world):
    """(backend, ulysses_degree, uneven, packed, rotate); packed: None, 'position_ids', 'dense' or
    'startend' (PaddleFormers' attn_mask_startend_row_indices)."""
    table = [
        ("p2p", None, False, None, "ring"),
        ("all2all", None, False, None, "ring"),
        ("p2p", None, True, "position_ids", "allgather"),
        ("all2all", None, True, "dense", "ring"),
        ("p2p", None, True, "startend", "ring"),
    ]
    if world == 4:
        table.append(("hybrid", 2, True, "position_ids", "ring"))
    return table


def adamw(model):
    # AdamW divides each gradient by its own magnitude (+ epsilon): an element
    # whose gradient is ~1e-8 would turn fp32 rounding into a whole-lr step.
    # epsilon=1e-5 bounds that amplification below the 1e-5 parameter budget.
    return paddle.optimizer.AdamW(learning_rate=1e-3, epsilon=1e-5, parameters=model.parameters())


def reference(source, seq, packed):
    paddle.seed(2024)
    model = build_llama(source)
    opt = adamw(model)
    ids, labels, positions, mask, _ = make_batch(seq, packed)
    losses, grads = [], None
    for step in range(STEPS):
        loss = loss_of(model(input_ids=ids, labels=labels, position_ids=positions, attention_mask=mask))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, grads, {n: p.numpy() for n, p in model.named_parameters()}


def parallel(source, seq, mesh, backend, degree, packed, rotate):
    paddle.seed(2024)
    model = build_llama(source)
    opt = adamw(model)
    prepare = pcp.PrepareContextParallel(backend, degree, documents="position_ids" if packed == "position_ids" else None)
    attention = pcp.ContextParallel(backend, degree, rotate=rotate)
    top = "" if source == "tiny" else "model"
    plan = {top: prepare, "model.layers.*.self_attn": attention}
    model, opt = pcp.parallelize(model, opt, mesh, {"cp_config": {"parallelize_plan": plan}})
    ids, labels, positions, mask, ends = make_batch(seq, packed)
    extra = {"attention_mask": mask} if packed == "dense" else {}
    if packed == "startend":
        extra = {"attn_mask_startend_row_indices": ends}
    local_labels = pcp.shard_sequence(labels, backend=prepare, mesh=mesh)
    if source != "tiny":
        labels = local_labels
    weight = pcp.loss_weight(local_labels.numel(), mesh)
    world = mesh.shape[mesh.dim_names.index("sep")]
    losses, grads = [], None
    for step in range(STEPS):
        loss = loss_of(model(input_ids=ids, labels=labels, position_ids=positions, **extra)) * weight
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
    names = []
    for source in sys.argv[1:]:
        references = {}
        for backend, degree, uneven, packed, rotate in runs(world):
            if packed == "startend" and source == "tiny":
                continue  # a PaddleFormers input
            seq = 8 * world + (3 if uneven else 0)
            key = (seq, bool(packed))
            if key not in references:
                references[key] = reference(source, seq, bool(packed))
            ref_losses, ref_grads, ref_params = references[key]
            name = f"{source}.{backend}{'.uneven' if uneven else ''}{'.' + packed if packed else ''}.{rotate}"
            names.append(name)
            losses, grads, params = parallel(source, seq, mesh, backend, degree, packed, rotate)
            report.value(f"{name}.losses", losses)
            report.diff(f"{name}.loss", np.array(losses), np.array(ref_losses))
            for param, value in ref_grads.items():
                report.diff(f"{name}.grad", grads[param], value)
            for param, value in ref_params.items():
                report.diff(f"{name}.param", params[param], value)
    report.value("runs", names)


run(main)
