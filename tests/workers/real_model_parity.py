"""PaddleFormers models as users build them (default eager attention) trained 3 AdamW steps under
parallelize vs one process with the model's own eager attention on the same batch.

argv: the runs, each "family:backend[:degree][:padded][:packed][:allgather][:sdpa|flashmask][:recompute]"; every sequence is uneven (8N+3
tokens). "padded": a 2-D attention_mask marks the last tokens of one row as padding (labels -100 there);
"allgather": k/v blocks rotate by all-gather instead of ring hops; "packed": documents given as
PaddleFormers' causal attn_mask_startend_row_indices [b, 1, s, 1]; "sdpa" or "flashmask": the
parallel model is built with that _attn_implementation (the reference stays eager);
"core_attn" / "core_attn_plain" / "full_recompute": the parallel model recomputes (RECOMPUTE below).
Also records the error for a RoPE that reads the length from local positions.
"""
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from paddleformers_models import build
from report import mean_over_ranks, run, train

import paddle_cp as pcp

STEPS = 3
PAD = 4


def adamw(model):
    return paddle.optimizer.AdamW(learning_rate=1e-3, epsilon=1e-3, parameters=model.parameters())


def make_batch(seq, padded, packed):
    """ids, labels and the extra model inputs (a 2-D padding mask, or documents' end rows)."""
    paddle.seed(99)
    ids = paddle.randint(0, 128, [2, seq + 1])
    ids, labels = ids[:, :-1], ids[:, 1:]
    extra = {}
    if padded:
        mask = np.ones((2, seq), "int64")
        mask[1, -PAD:] = 0
        labels = paddle.where(paddle.to_tensor(mask, "bool"), labels, paddle.full([], -100, labels.dtype))
        extra["attention_mask"] = paddle.to_tensor(mask)
    if packed:  # documents [0, 7), [7, seq) and [0, 10), [10, seq): key j is seen by rows j..end-1
        ends = np.array([[7] * 7 + [seq] * (seq - 7), [10] * 10 + [seq] * (seq - 10)])
        extra["attn_mask_startend_row_indices"] = paddle.to_tensor(ends[:, None, :, None], dtype="int32")
    return ids, labels, extra


def reference(family, seq, padded, packed):
    paddle.seed(2024)
    model = build(family)
    ids, labels, extra = make_batch(seq, padded, packed)
    return train(model, adamw(model), (model(input_ids=ids, labels=labels, **extra)[0] for _ in range(STEPS)))


RECOMPUTE = {  # spec word -> PaddleFormers' own recompute flags (use_cache off: a cached layer re-run in
    # backward appends its k/v to the cache again, which fails on one card too)
    "core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"], recompute_use_reentrant=True),
    "core_attn_plain": dict(recompute_granularity="selective", recompute_modules=["core_attn"],
                            recompute_use_reentrant=False),
    "full_recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                           use_cache=False),
}


def parallel(family, seq, mesh, backend, degree, padded, packed, rotate, implementation, recompute=None):
    paddle.seed(2024)
    model = build(family, _attn_implementation=implementation, **RECOMPUTE.get(recompute, {}))
    opt = adamw(model)
    prepare = pcp.PrepareContextParallel(backend, degree)
    plan = {"model": prepare, "model.layers.*.self_attn": pcp.ContextParallel(backend, degree, rotate)}
    model, opt = pcp.parallelize(model, opt, mesh, {"cp_config": {"parallelize_plan": plan}})
    ids, labels, extra = make_batch(seq, padded, packed)
    labels = pcp.shard_sequence(labels, backend=prepare, mesh=mesh,
                                attn_mask_startend_row_indices=extra.get("attn_mask_startend_row_indices"))
    weight = pcp.loss_weight(int((labels != -100).sum()), mesh)
    losses, grads, params = train(model, opt, (model(input_ids=ids, labels=labels, **extra)[0] * weight
                                               for _ in range(STEPS)))
    return mean_over_ranks(losses, mesh), grads, params


def check_length_dependent_rope(report, mesh):
    model = build("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    plan = {"model": pcp.PrepareContextParallel(), "model.layers.*.self_attn": pcp.ContextParallel()}
    report.expect_error("dynamic_rope", lambda: pcp.parallelize(model, None, mesh, {"cp_config": {"parallelize_plan": plan}}))


def main(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    seq = 8 * world + 3
    references = {}
    names = []
    for spec in sys.argv[1:]:
        family, backend, *rest = spec.split(":")
        padded, packed = "padded" in rest, "packed" in rest
        degree = next((int(x) for x in rest if x.isdigit()), None)
        if (family, padded, packed) not in references:
            references[family, padded, packed] = reference(family, seq, padded, packed)
        rotate = "allgather" if "allgather" in rest else "planned"
        implementation = next((x for x in rest if x in ("sdpa", "flashmask")), "eager")
        recompute = next((x for x in rest if x in RECOMPUTE), None)
        got = parallel(family, seq, mesh, backend, degree, padded, packed, rotate, implementation, recompute)
        names.append(spec)
        report.value(f"{spec}.grads_compared", sorted(set(got[1]) & set(references[family, padded, packed][1])))
        report.training(spec, got, references[family, padded, packed])
    report.value("runs", names)
    check_length_dependent_rope(report, mesh)


if __name__ == "__main__":
    run(main)
