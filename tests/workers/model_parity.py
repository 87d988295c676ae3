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
from typing import NamedTuple, Optional

import paddle
import paddle.distributed as dist
from batches import make_batch
from llama_models import build_llama, loss_of
from report import mean_over_ranks, run, train

import paddle_cp as pcp

STEPS = 3


class Run(NamedTuple):
    backend: str
    degree: Optional[int] = None  # ulysses_degree (hybrid)
    uneven: bool = False          # a length that does not divide over the ranks
    packed: Optional[str] = None  # None, "position_ids", "dense" or "startend" (attn_mask_startend_row_indices)
    rotate: str = "planned"


def runs(world):
    table = [
        Run("p2p"),
        Run("all2all"),
        Run("p2p", uneven=True, packed="position_ids", rotate="allgather"),
        Run("all2all", uneven=True, packed="dense"),
        Run("p2p", uneven=True, packed="startend"),
    ]
    if world == 4:
        table.append(Run("hybrid", 2, uneven=True, packed="position_ids"))
    return table


def adamw(model):
    # AdamW divides each gradient by its own magnitude (+ epsilon): an element
    # whose gradient is ~1e-8 would turn fp32 rounding into a whole-lr step.
    # epsilon=1e-5 bounds that amplification below the 1e-5 parameter budget.
    return paddle.optimizer.AdamW(learning_rate=1e-3, epsilon=1e-5, parameters=model.parameters())


def reference(source, seq, packed):
    paddle.seed(2024)
    model = build_llama(source)
    ids, labels, positions, mask, _ = make_batch(seq, packed)
    return train(model, adamw(model), (loss_of(model(input_ids=ids, labels=labels, position_ids=positions,
                                                      attention_mask=mask)) for _ in range(STEPS)))


def parallel(source, seq, mesh, spec):
    backend, degree, packed = spec.backend, spec.degree, spec.packed
    paddle.seed(2024)
    model = build_llama(source)
    opt = adamw(model)
    prepare = pcp.PrepareContextParallel(backend, degree, documents="position_ids" if packed == "position_ids" else None)
    attention = pcp.ContextParallel(backend, degree, rotate=spec.rotate)
    top = "" if source == "tiny" else "model"
    plan = {top: prepare, "model.layers.*.self_attn": attention}
    model, opt = pcp.parallelize(model, opt, mesh, {"cp_config": {"parallelize_plan": plan}})
    ids, labels, positions, mask, ends = make_batch(seq, packed)
    extra = {"attention_mask": mask} if packed == "dense" else {}
    if packed == "startend":
        extra = {"attn_mask_startend_row_indices": ends}
    # the batch's documents decide its layout: labels split with the inputs' document inputs
    local_labels = pcp.shard_sequence(labels, backend=prepare, mesh=mesh, position_ids=positions,
                                      attn_mask_startend_row_indices=extra.get("attn_mask_startend_row_indices"))
    if source != "tiny":
        labels = local_labels
    weight = pcp.loss_weight(local_labels.numel(), mesh)
    losses, grads, params = train(model, opt, (loss_of(model(input_ids=ids, labels=labels, position_ids=positions,
                                                             **extra)) * weight for _ in range(STEPS)))
    return mean_over_ranks(losses, mesh), grads, params


def main(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    names = []
    for source in sys.argv[1:]:
        references = {}
        for spec in runs(world):
            if spec.packed == "startend" and source == "tiny":
                continue  # a PaddleFormers input
            seq = 8 * world + (3 if spec.uneven else 0)
            key = (seq, bool(spec.packed))
            if key not in references:
                references[key] = reference(source, seq, bool(spec.packed))
            name = (f"{source}.{spec.backend}{'.uneven' if spec.uneven else ''}"
                    f"{'.' + spec.packed if spec.packed else ''}.{spec.rotate}")
            names.append(name)
            got = parallel(source, seq, mesh, spec)
            report.training(name, got, references[key])
    report.value("runs", names)


run(main)
