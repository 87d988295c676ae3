"""SequenceTiled MLPs and OffloadRecomputeInputs on PaddleFormers' Llama vs one card with neither (3 AdamW steps,
epsilon 1e-3, fp32).

argv[1] == "sep": a 1-D sep mesh of all ranks, ring, Ulysses and (4 ranks) hybrid U=2, each tiled without and
with PaddleFormers' full recomputation, tiled and offloaded, offloaded alone; uneven lengths (each rank's loss
weighted by pcp.loss_weight), tiles shorter than a rank's tokens and a last tile shorter than the others. Bad
settings are refused on every rank before any collective. argv[1] == "composed" (4 ranks): pp2 x sep2 with
recomputation (reentrant, tiled and offloaded; non-reentrant, tiled), dp2 x sep2 at sharding levels 1, 2 and 3
with recomputation, tiles and offload, compared through full_state_dict (pipeline.compare). argv[1] == "level3"
(2 ranks): a ring over sep sharded at level 3 (over sep) at a length that leaves the two ranks different numbers of
tiles, without and with recomputation; each tiled MLP's weights fetched once per forward and once per backward.
"""
import sys

import paddle
import paddle.distributed as dist
from batches import make_batch
from llama_models import build_llama, loss_of
from pipeline import compare, llama_recompute, model_loss, pp_mesh
from report import mean_over_ranks, run, train_steps

import paddle_cp as pcp
from paddle_cp.data_parallel import parameter_fetch

STEPS = 3
TILE = 4  # tokens per tile: several tiles per rank, the last one shorter
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def adamw(model):
    return paddle.optimizer.AdamW(learning_rate=1e-3, epsilon=1e-3, parameters=model.parameters())


def build(recompute):
    paddle.seed(2024)
    return build_llama("paddleformers", **(RECOMPUTE if recompute else {}))


def train(model, opt, ids, loss_fn):
    return train_steps(model, opt, [ids], loss_fn, STEPS)


def plan(backend, degree, tile=TILE, offload=None):
    plans = {"": pcp.PrepareContextParallel(backend, degree),
             "model.layers.*.self_attn": pcp.ContextParallel(backend, degree)}
    if tile:
        plans["model.layers.*.mlp"] = pcp.SequenceTiled(tokens=tile)
    if offload:
        plans["model.layers.*"] = offload
    return plans


def memory_run(mesh, backend, degree, recompute, tile, offload, ids, labels):
    model = build(recompute)
    plans = plan(backend, degree, tile, offload)
    prepare = plans[""]
    model, opt = pcp.parallelize(model, adamw(model), mesh, {"cp_config": {"parallelize_plan": plans}})
    local = pcp.shard_sequence(labels, backend=prepare, mesh=mesh)
    weight = pcp.loss_weight(local.numel(), mesh)
    calls = []  # the first MLP's gate projection runs once per tile per forward or replay
    model.model.layers[0].mlp.gate_proj.register_forward_pre_hook(lambda layer, inputs: calls.append(1))
    losses, grads, params = train(model, opt, ids, lambda m, x: loss_of(m(input_ids=x, labels=local)) * weight)
    return (mean_over_ranks(losses, mesh), grads, params), len(calls), int(local.numel())


def bad_settings(report, mesh):
    """Every one raises here, before parallelize (or the forward) runs a collective (a rank that went on would hang)."""
    for name, tokens in (("zero", 0), ("negative", -8), ("bool", True), ("float", 2.5)):
        report.expect_error(f"bad.{name}", lambda tokens=tokens: pcp.SequenceTiled(tokens=tokens))
    for name, key in (("no_layer", "model.layers.*.mlpp"), ("attention", "model.layers.*.self_attn"),
                      ("decoder_layer", "model.layers.*"), ("parameter", "model.layers.*.mlp.gate_proj.weight")):
        model = build(False)
        bad = plan("p2p", None, tile=None)
        bad[key] = [pcp.ContextParallel("p2p"), pcp.SequenceTiled(tokens=4)] if key.endswith("self_attn") else \
            pcp.SequenceTiled(tokens=4)
        report.expect_error(f"bad.{name}", lambda: pcp.parallelize(model, adamw(model), mesh,
                                                                    {"cp_config": {"parallelize_plan": bad}}))
    model = build(False)  # PaddleFormers' config says it does not recompute: refused at parallelize
    report.expect_error("bad.offload_without_recompute", lambda: pcp.parallelize(
        model, adamw(model), mesh, {"cp_config": {"parallelize_plan": plan("p2p", None, 0, pcp.OffloadRecomputeInputs())}}))
    model = build(True)  # its flags said full at parallelize, but this forward records a graph without recompute
    model, _ = pcp.parallelize(model, None, mesh, {"cp_config": {"parallelize_plan": plan(
        "p2p", None, 0, pcp.OffloadRecomputeInputs())}})
    model.config.recompute_granularity = None
    ids, labels, _, _, _ = make_batch(8 * dist.get_world_size(), None)
    report.expect_error("bad.offload_unrecomputed_forward", lambda: model(input_ids=ids, labels=labels))


def sep(report):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["sep"])
    bad_settings(report, mesh)
    ids, labels, _, _, _ = make_batch(8 * world + 3, None)
    model = build(False)
    losses, grads, params = train(model, adamw(model), ids, lambda m, x: loss_of(m(input_ids=x, labels=labels)))
    reference = ([float(x) for x in losses], grads, params)
    backends = [("p2p", None), ("all2all", None)] + ([("hybrid", 2)] if world == 4 else [])
    variants = {"plain": (False, TILE, False), "recompute": (True, TILE, False),
                "recompute.offload": (True, TILE, True), "recompute.offload_only": (True, 0, True)}
    names = []
    for backend, degree in backends:
        for variant, (recompute, tile, offload) in variants.items():
            name = f"{backend}.{variant}"
            store = pcp.OffloadRecomputeInputs() if offload else None
            got, calls, local = memory_run(mesh, backend, degree, recompute, tile, store, ids, labels)
            report.training(name, got, reference)
            report.value(f"{name}.mlp_calls", calls)
            report.value(f"{name}.local_rows", local)
            if store is not None:
                report.value(f"{name}.offload", {**store.store.counts, "host_bytes_after": store.store.host_bytes,
                                                 "host_peak": store.store.host_peak})
            names.append(name)
    report.value("runs", names)


def composed(report):
    tiled = {"model.layers.*.mlp": pcp.SequenceTiled(tokens=3)}
    ring = {"": pcp.PrepareContextParallel("p2p"), "model.layers.*.self_attn": pcp.ContextParallel("p2p")}
    base = {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "accumulate_steps": 2}
    for reentrant in (True, False):  # the non-reentrant recompute saves each op's tensors: no offload there
        name = f"pp2_sep2_recompute_{'reentrant_offload' if reentrant else 'plain'}"
        offload = {"model.layers.*": pcp.OffloadRecomputeInputs()} if reentrant else {}
        cp = {"cp_config": {"parallelize_plan": {**ring, **tiled, **offload}}}
        with llama_recompute(report, name, reentrant) as make:
            compare(report, name, make, 64, pp_mesh([2, 2], ["pp", "sep"]), {**cp, "pp_config": base}, model_loss)
        if offload:
            report.value(f"{name}.offloaded", offload["model.layers.*"].store.counts["offloaded"])
    for level in (1, 2, 3):
        offload = pcp.OffloadRecomputeInputs()
        cp = {"cp_config": {"parallelize_plan": {**ring, **tiled, "model.layers.*": offload}}}
        name = f"dp2_sep2_l{level}"
        with llama_recompute(report, name, True) as make:
            compare(report, name, make, 64, pp_mesh([2, 2], ["dp", "sep"]), {**cp, "dp_config": {"sharding_level": level}},
                    model_loss)
        report.value(f"{name}.offloaded", offload.store.counts["offloaded"])


def counting_fetches(layer):
    """{parameter name: level-3 fetches (broadcasts of its full value)} of `layer`'s parameters, counted while the
    returned `restore` has not been called."""
    names = {id(p): n for n, p in layer.named_parameters()}
    counts = dict.fromkeys(names.values(), 0)
    fetch = parameter_fetch.broadcast_full

    def counted(param, *args, **kwargs):
        if id(param) in names:
            counts[names[id(param)]] += 1
        return fetch(param, *args, **kwargs)

    parameter_fetch.broadcast_full = counted
    return counts, lambda: setattr(parameter_fetch, "broadcast_full", fetch)


def level3(report):
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["sep"])
    ids, labels, _, _, _ = make_batch(65, None)  # 65 tokens over 4 ring chunks: 33 and 32 per rank, x2 sequences
    model = build(False)
    losses, grads, params = train(model, adamw(model), ids, lambda m, x: loss_of(m(input_ids=x, labels=labels)))
    for recompute in (False, True):
        name = f"l3.{'recompute' if recompute else 'plain'}"
        model = build(recompute)
        plans = plan("p2p", None)
        model, opt = pcp.parallelize(model, adamw(model), mesh, {"cp_config": {"parallelize_plan": plans},
                                                                 "dp_config": {"sharding_level": 3}})
        local = pcp.shard_sequence(labels, backend=plans[""], mesh=mesh)
        weight = pcp.loss_weight(local.numel(), mesh)
        mlp = model.model.layers[0].mlp
        calls = []  # once per tile per forward or replay
        mlp.gate_proj.register_forward_pre_hook(lambda layer, inputs: calls.append(1))
        fetches, restore = counting_fetches(mlp)
        got_losses, got_grads = [], 0
        try:
            for step in range(STEPS):
                loss = loss_of(model(input_ids=ids, labels=local)) * weight
                loss.backward()
                opt.step()
                if step == 0:  # the reduced gradients of the parameters this rank owns (level 3 frees the others')
                    for n, p in model.named_parameters():
                        if p.grad is not None and p.grad._is_initialized():
                            report.diff(f"{name}.grad", p.grad.numpy(), grads[n])
                            got_grads += 1
                opt.clear_grad()
                got_losses.append(loss)
        finally:
            restore()
        report.diff(f"{name}.loss", mean_over_ranks(got_losses, mesh), [float(x) for x in losses])
        state = pcp.full_state_dict(model)
        for n, value in params.items():
            report.diff(f"{name}.param", state[n], value)
        report.value(f"{name}.grads_compared", got_grads)
        report.value(f"{name}.fetches", fetches)
        report.value(f"{name}.mlp_calls", len(calls))
        report.value(f"{name}.local_rows", int(local.numel()))
        buckets = opt.gradient_buckets.buckets  # a fetch unit, but not one whose sublayers run by the data
        report.value(f"{name}.mlp_reduced_in_backward", all(
            bucket.early for p in mlp.parameters() for bucket in buckets if any(q is p for q in bucket.params)))


def main(report):
    dist.init_parallel_env()
    for group in sys.argv[1:]:
        {"sep": sep, "composed": composed, "level3": level3}[group](report)


run(main)
