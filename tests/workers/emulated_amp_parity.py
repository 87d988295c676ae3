"""bf16 O2 through paddle_cp on 4 CPU ranks, in the CPU emulation of Paddle's AMP (emulated_amp), against
one card in the same emulation and against an fp32 run of the same steps.

Every run trains a tiny PaddleFormers Llama (unfused projections, eager attention) STEPS AdamW steps of ACC
micro-batches each (`(loss / ACC).backward()`), the forward under `auto_cast(level="O2", dtype="bfloat16")`,
the model and optimizer decorated O2 bfloat16 with master gradients before or after `parallelize`.
Distances from the fp32 one-card run (`distances`): the losses' largest difference; the first step's
reduced gradients (level 0) and the final weights (fp32 master weights, gathered through a checkpoint) as
relative L2 norms (the weights' relative to the fp32 run's update, final minus initial). One card's own distance (the emulated bf16 card against
fp32) is the yardstick.

Also: with master gradients each reduced gradient against the float64 mean of the ranks' fp32 local
gradients, and the reduction's bytes per element (counters); the same without master gradients; a
planted bf16 reduction (`gradient_dtype` patched to the parameter's dtype); a gloo float16 all-reduce;
a bf16 O2 checkpoint saved on dp2 x mp2 (level 2) resumed on dp4 (level 3); an fp32 checkpoint loaded into
an O2 run (its parameters become the master weights); MixPrecisionLayer's main_grad refused.
"""
import os
from unittest import mock

import emulated_amp
import numpy as np
import paddle
import paddle.distributed as dist
from report import run
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
from tensor_parallel import _tiny_config, full_gradients, llama, sequence_parallel_plan

import paddle_cp as pcp
from paddle_cp.checkpoint.format import MODEL_DIR, OPTIMIZER_DIR, BoxReader, read_metadata
from paddle_cp.comm import collectives, counters
from paddle_cp.data_parallel import buckets as buckets_module
from paddle_cp.data_parallel.buckets import has_gradient
from paddle_cp.data_parallel.optimizer import OwnGradients
from paddle_cp.mesh import mesh_group

BATCH, SEQ, ACC, STEPS = 4, 16, 2, 2
LR, EPSILON = 1e-3, 1e-3
BUCKET_MB = 0.05  # the tiny Llama's 82240 gradients in several buckets


def cp_plan(backend, degree=None, tile=None, offload=False):
    plan = {"model": pcp.PrepareContextParallel(backend, degree),
            "model.layers.*.self_attn": pcp.ContextParallel(backend, degree)}
    if tile:
        plan["model.layers.*.mlp"] = pcp.SequenceTiled(tokens=tile)
    if offload:
        plan["model.layers.*"] = pcp.OffloadRecomputeInputs()
    return plan


# name: (mesh dims, sharding level, decorate before parallelize, mp plan, cp plan, extra dp_config)
RUNS = {
    "dp4_l0_after": ([("dp", 4)], 0, False, None, None, {}),
    "dp2xmp2_sp_l1_before": ([("dp", 2), ("mp", 2)], 1, True, sequence_parallel_plan, None, {}),
    "dp2xmp2_l2_after": ([("dp", 2), ("mp", 2)], 2, False, sequence_parallel_plan, None, {}),
    "dp4_l3_before": ([("dp", 4)], 3, True, None, None, {}),
    "dp4_l3_after": ([("dp", 4)], 3, False, None, None, {}),
    "dp4_l2_host_optimizer": ([("dp", 4)], 2, True, None, None, {"offload_optimizer": True}),
    "sep4_ring_after": ([("sep", 4)], 0, False, None, cp_plan("p2p"), {}),
    "dp2xsep2_ulysses_before": ([("dp", 2), ("sep", 2)], 0, True, None, cp_plan("all2all"), {}),
    "sep4_hybrid_tiles_l2_after": ([("sep", 4)], 2, False, None, cp_plan("hybrid", 2, tile=2), {}),
    # recomputed layers (replayed under the forward's autocast) whose inputs wait in host memory
    "sep4_ring_recompute_offload_before": ([("sep", 4)], 0, True, None, cp_plan("p2p", offload=True), {}),
}
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def batches():
    rng = np.random.RandomState(5)
    return [tuple(paddle.to_tensor(rng.randint(0, 128, [BATCH, SEQ]), dtype="int64") for _ in range(2))
            for _ in range(STEPS * ACC)]


def build(amp, master_grad=True, recompute=False, dtype="bfloat16"):
    """(model, optimizer): the seed's Llama (the same weights recomputed or not) and an AdamW; `amp` decorates
    O2 bf16 here (before parallelize)."""
    emulated_amp.reset()
    paddle.seed(2024)
    model = llama() if not recompute else LlamaForCausalLM(LlamaConfig(**_tiny_config(), **RECOMPUTE))
    optimizer = paddle.optimizer.AdamW(learning_rate=LR, epsilon=EPSILON, weight_decay=0.01,
                                       parameters=model.parameters(), multi_precision=amp)
    if amp:
        model, optimizer = decorate(model, optimizer, master_grad, dtype)
    return model, optimizer


def decorate(model, optimizer, master_grad=True, dtype="bfloat16"):
    return paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype=dtype,
                               master_grad=master_grad)


def fp32(tensor):
    return tensor.astype("float32").numpy() if tensor.dtype != paddle.float32 else tensor.numpy()


def train(model, optimizer, amp, shard=None, at_first_step=None, steps=STEPS, data=None, dtype="bfloat16"):
    """(each step's loss, the first step's gradients {name: fp32}, {name: fp32 parameter}) after `steps`."""
    losses, grads = [], {}
    for step in range(steps):
        total = 0.0
        for ids, labels in (data or batches())[step * ACC:(step + 1) * ACC]:
            if shard is not None:
                ids, labels = shard(ids, labels)
            with paddle.amp.auto_cast(enable=amp, level="O2", dtype=dtype):
                loss = model(input_ids=ids, labels=labels)[0] / ACC
            loss.backward()
            total += float(loss.astype("float32"))
        if step == 0 and at_first_step is not None:
            grads = at_first_step()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(total)
    return losses, grads


def one_card(amp):
    """(losses, first-step gradients, final weights, initial weights); weights are the fp32 master weights
    of a bf16 run (what its steps update: a bf16 parameter moves by whole ulps, an RMSNorm weight near 1 not
    at all at this learning rate)."""
    model, optimizer = build(amp)
    initial = {n: fp32(p) for n, p in model.named_parameters()}
    losses, grads = train(model, optimizer, amp, at_first_step=lambda: {
        n: fp32(p.grad) for n, p in model.named_parameters() if p.grad is not None})
    masters = optimizer._master_weights
    weights = {n: (masters[p.name] if amp else p).numpy() for n, p in model.named_parameters()}
    return np.array(losses), grads, weights, initial


def master_weights(name, model, optimizer):
    """{parameter name: full fp32 master weight}, gathered through a checkpoint (any mesh, level, host)."""
    path = os.path.join(os.environ["PCP_REPORT_DIR"], "masters", name)
    pcp.save_checkpoint(path, model, optimizer)
    directory = os.path.join(path, OPTIMIZER_DIR)
    reader = BoxReader(directory, read_metadata(directory))
    return {k[:-len(".w_0")]: np.asarray(reader.full(k), np.float32)
            for k in reader.metadata.state_dict_metadata if k.endswith(".w_0")}


def _relative(got, want, base=None):
    base = want if base is None else base
    num = sum(float(np.sum((got[k].astype(np.float64) - want[k]) ** 2)) for k in want)
    den = sum(float(np.sum(base[k].astype(np.float64) ** 2)) for k in base)
    return float(np.sqrt(num / den))


def distances(result, truth):
    """{loss, grad, weights} of `result` from `truth` (one_card(False)): see the module docstring."""
    (losses, grads, params), (t_losses, t_grads, t_params, t_initial) = result[:3], truth
    update = {k: t_params[k] - t_initial[k] for k in t_params}
    out = {"loss": float(np.abs(np.array(losses) - t_losses).max()),
           "weights": _relative(params, t_params, update)}
    if grads:
        out["grad"] = _relative(grads, t_grads)
    return out


def world_mean(value):
    total = paddle.to_tensor(value, dtype="float32")
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def parallel_run(name, dims, level, before, mp_plan, cp, dp_config, master_grad=True, first_step=None,
                 keep=False, dtype="bfloat16"):
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(np.arange(world).reshape([d for _, d in dims]).tolist(), dim_names=[n for n, _ in dims])
    offloads = cp is not None and any(isinstance(p, pcp.OffloadRecomputeInputs) for p in cp.values())
    model, optimizer = build(before, master_grad, recompute=offloads, dtype=dtype)
    config = {"dp_config": {"sharding_level": level, **dp_config}}
    if mp_plan is not None:
        config["mp_config"] = {"parallelize_plan": mp_plan()}
    if cp is not None:
        config["cp_config"] = {"parallelize_plan": cp}
    model, optimizer = pcp.parallelize(model, optimizer, mesh=mesh, config=config)
    if not before:
        model, optimizer = decorate(model, optimizer, master_grad, dtype)

    def shard(ids, labels):
        ids, labels = pcp.shard_batch((ids, labels), mesh=mesh)
        return ids, (pcp.shard_sequence(labels, backend=cp["model"], mesh=mesh) if cp else labels)

    def at_first_step():
        finish = first_step(model, optimizer) if first_step is not None else None  # before the reduction
        optimizer.reduce_gradients()
        grads = {n: fp32(paddle.to_tensor(g)) for n, g in full_gradients(model).items()} if level == 0 else {}
        return (grads, finish()) if first_step is not None else grads

    losses, grads = train(model, optimizer, True, shard, at_first_step, dtype=dtype)
    grads, extra = grads if first_step is not None else (grads, None)
    result = ([world_mean(x) for x in losses], grads, master_weights(name, model, optimizer), extra)
    return (result, model, optimizer, mesh, shard) if keep else result


def local_gradients_then_mean(model, optimizer):
    """Before the step's reduction (dp only): this rank's local gradients (a level-3 non-owner's in its
    stash), their float64 mean over the ranks, byte counters started; returns what, after the reduction,
    gives (mean, local dtypes, elements, buckets, {name: this rank's reduced gradient, where it has one})."""
    gradients = optimizer._sharding or OwnGradients
    local = {n: gradients.gradient(p) for n, p in model.named_parameters() if not p.stop_gradient}
    mean = {}
    for n, g in local.items():
        gathered = []
        dist.all_gather(gathered, g.astype("float32"))
        mean[n] = np.mean([x.numpy().astype(np.float64) for x in gathered], axis=0)
    dtypes = sorted({str(g.dtype) for g in local.values()})
    elements = sum(int(np.prod(g.shape)) for g in local.values())
    buckets = len(optimizer.gradient_buckets.buckets)
    counters.reset()

    def after_reduction():
        reduced = {n: fp32(p.grad) for n, p in model.named_parameters() if has_gradient(p.grad)}
        return mean, dtypes, elements, buckets, reduced
    return after_reduction


def master_gradient_check(report, name, master_grad, planted=False, level=0, dtype="bfloat16"):
    """dp4, decorate after parallelize, small buckets: each reduced gradient (level 0: every rank's; level 3:
    the owner's, reduce-scattered, non-owners' stashed) against the float64 mean of the ranks' local
    gradients; bytes per element of the reduction (a ring all-reduce sends 2(n-1)/n of its buffer); how many
    buckets before and after the first step."""
    patch = mock.patch.object(buckets_module, "gradient_dtype", lambda p: p.dtype) if planted else None
    if patch:
        patch.start()
    try:
        (losses, grads, params, extra), model, optimizer, *_ = parallel_run(
            name, [("dp", 4)], level, False, None, None, {"bucket_size_mb": BUCKET_MB}, master_grad=master_grad,
            first_step=local_gradients_then_mean, keep=True, dtype=dtype)
    finally:
        if patch:
            patch.stop()
    mean, local_dtypes, elements, first_buckets, reduced = extra
    report.value(f"{name}.reduced_here", len(reduced))
    # cut at parallelize by fp32 sizes; after the first step by the reduced gradients' dtypes
    report.value(f"{name}.buckets", {"first_step": first_buckets, "after": len(optimizer.gradient_buckets.buckets),
                                     "planned_now": len(buckets_module.plan_buckets(
                                         model, list(model.parameters()), BUCKET_MB)[0])})
    # a ring all-reduce sends 2(n-1)/n of its buffer, a reduce-scatter (n-1)/n (on gloo an empty chunk travels
    # as one zero: a few bytes more), n = 4
    tag, share = ("grad_all_reduce", 2 * 3 / 4) if level == 0 else ("grad_reduce_scatter", 3 / 4)
    sent = counters.bytes_sent(tag)
    report.value(f"{name}.reduction_calls", counters.collectives_issued(tag))
    worst = max(float(np.abs(reduced[k] - mean[k]).max() / np.abs(mean[k]).max()) for k in reduced)
    report.value(f"{name}.reduced_vs_fp32_mean", worst)
    report.value(f"{name}.local_grad_dtypes", local_dtypes)
    report.value(f"{name}.bytes_per_element", sent / (elements * share) / STEPS)
    return losses, grads, params


def checkpoint_resume(report, truth):
    """A bf16 O2 run on dp2 x mp2 at level 2 saves after STEPS steps; dp4 at level 3 loads it: parameters,
    master weights and moments as saved (saved again from dp4: identical files), one more step on both meshes
    against each other and against fp32."""
    root = os.path.join(os.environ["PCP_REPORT_DIR"], "masters")  # parallel_run saved its checkpoint there
    (result, model, optimizer, _, shard) = parallel_run(
        "a", [("dp", 2), ("mp", 2)], 2, False, sequence_parallel_plan, None, {}, keep=True)
    more = batches()[-ACC:]
    train(model, optimizer, True, shard, steps=1, data=more)
    uninterrupted = master_weights("a_more", model, optimizer)

    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["dp"])
    model_b, optimizer_b = build(False)
    model_b, optimizer_b = pcp.parallelize(model_b, optimizer_b, mesh=mesh, config={"dp_config": {"sharding_level": 3}})
    model_b, optimizer_b = decorate(model_b, optimizer_b)
    pcp.load_checkpoint(os.path.join(root, "a"), model_b, optimizer_b)
    pcp.save_checkpoint(os.path.join(root, "b"), model_b, optimizer_b)  # at once: what it loaded
    report.value("ckpt.files_equal", _checkpoint_difference(os.path.join(root, "a"), os.path.join(root, "b")))

    def shard_b(ids, labels):
        return pcp.shard_batch((ids, labels), mesh=mesh)

    train(model_b, optimizer_b, True, shard_b, steps=1, data=more)
    resumed = master_weights("b_more", model_b, optimizer_b)
    report.value("ckpt.resumed_vs_uninterrupted",
                 _relative(resumed, uninterrupted, {k: truth[2][k] - truth[3][k] for k in truth[2]}))


def _checkpoint_difference(a, b):
    """{model/optimizer directory: largest difference of any tensor, keys equal}: 0.0 when b holds a's values."""
    out = {}
    for part in (MODEL_DIR, OPTIMIZER_DIR):
        da, db = os.path.join(a, part), os.path.join(b, part)
        ma, mb = read_metadata(da), read_metadata(db)
        ra, rb = BoxReader(da, ma), BoxReader(db, mb)
        keys = sorted(ma.state_dict_metadata)
        out[part] = {"keys_equal": keys == sorted(mb.state_dict_metadata),
                     "masters": sum(k.endswith(".w_0") for k in keys),
                     "max_abs": max(float(np.abs(np.asarray(ra.full(k), np.float64)
                                                 - np.asarray(rb.full(k), np.float64)).max()) for k in keys)}
    return out


def fp32_checkpoint_into_o2(report):
    """An fp32 run's checkpoint (dp4) loaded into an O2 run (dp2 x mp2, level 2): its parameters become the
    master weights exactly; the model holds their bf16 rounding."""
    root = os.path.join(os.environ["PCP_REPORT_DIR"], "ckpt")
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["dp"])
    model, optimizer = build(False)
    model, optimizer = pcp.parallelize(model, optimizer, mesh=mesh, config={"dp_config": {"sharding_level": 0}})
    train(model, optimizer, False, lambda ids, labels: pcp.shard_batch((ids, labels), mesh=mesh), steps=1)
    pcp.save_checkpoint(os.path.join(root, "fp32"), model, optimizer)
    mesh2 = dist.ProcessMesh(np.arange(world).reshape([2, 2]).tolist(), dim_names=["dp", "mp"])
    model2, optimizer2 = build(True)
    model2, optimizer2 = pcp.parallelize(model2, optimizer2, mesh=mesh2, config={
        "dp_config": {"sharding_level": 2}, "mp_config": {"parallelize_plan": sequence_parallel_plan()}})
    pcp.load_checkpoint(os.path.join(root, "fp32"), model2, optimizer2)
    pcp.save_checkpoint(os.path.join(root, "o2"), model2, optimizer2)
    saved, again = os.path.join(root, "fp32"), os.path.join(root, "o2")
    ra, rb = BoxReader(os.path.join(saved, MODEL_DIR), read_metadata(os.path.join(saved, MODEL_DIR))), \
        BoxReader(os.path.join(again, OPTIMIZER_DIR), read_metadata(os.path.join(again, OPTIMIZER_DIR)))
    keys = [k for k in rb.metadata.state_dict_metadata if k.endswith(".w_0")]
    report.value("fp32_into_o2.masters", len(keys))
    report.value("fp32_into_o2.master_vs_fp32_param", max(
        float(np.abs(np.asarray(rb.full(k)) - np.asarray(ra.full(k[:-len(".w_0")]))).max()) for k in keys))
    report.value("fp32_into_o2.model_dtypes", sorted({str(p.dtype) for p in model2.parameters()}))


def gloo_float16(report):
    """gloo all-reduce of float16 (Paddle's sums it wrongly) through paddle_cp's comm layer, and of bfloat16."""
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["dp"])
    group = mesh_group(mesh, ["dp"])
    counters.reset()
    for dtype in ("float16", "bfloat16"):
        x = paddle.to_tensor([1.0 + dist.get_rank(), 0.5, -3.0 * dist.get_rank()], dtype="float32").astype(dtype)
        collectives.all_reduce(group, x, tag=f"probe_{dtype}")
        report.value(f"gloo.{dtype}", [float(v) for v in x.astype("float32").numpy()])
    raw = paddle.to_tensor([1.0 + dist.get_rank()], dtype="float32").astype("float16")
    dist.all_reduce(raw)
    report.value("gloo.raw_float16", float(raw.astype("float32").numpy()[0]))
    report.value("gloo.widened", counters.widened_float16())
    report.value("gloo.bytes", {k: counters.bytes_sent(k) for k in ("probe_float16", "probe_bfloat16")})


def main_grad_refused(report):
    from paddle.distributed.fleet.utils import mix_precision_utils

    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["dp"])
    model, optimizer = build(True)
    model, optimizer = pcp.parallelize(model, optimizer, mesh=mesh, config={"dp_config": {"sharding_level": 0}})
    mix_precision_utils.MixPrecisionLayer(model, dtype="bfloat16")
    ids, labels = pcp.shard_batch(batches()[0], mesh=mesh)
    with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
        model(input_ids=ids, labels=labels)[0].backward()
    report.expect_error("main_grad", optimizer.step)


def main(report):
    emulated_amp.install()
    truth = one_card(False)
    card = one_card(True)
    own = distances(card, truth)
    report.value("one_card", own)
    # the losses are bf16 values (the cross entropy runs in bf16 under O2): half an ulp of the largest
    report.value("loss_half_ulp", emulated_amp.ROUNDING[paddle.bfloat16] / 2 * float(np.max(truth[0])))
    report.value("one_card.dtypes", sorted({str(v.dtype) for v in card[1].values()}))
    for name, (dims, level, before, mp_plan, cp, dp_config) in RUNS.items():
        result = parallel_run(name, dims, level, before, mp_plan, cp, dp_config)
        report.value(f"{name}.distance", distances(result, truth))
        report.value(f"{name}.weights_vs_bf16_card",
                     _relative(result[2], card[2], {k: truth[2][k] - truth[3][k] for k in truth[2]}))
    for name, master, planted, level in (("master", True, False, 0), ("no_master", False, False, 0),
                                         ("planted", True, True, 0), ("master_l3", True, False, 3),
                                         ("no_master_l3", False, False, 3)):
        result = master_gradient_check(report, name, master, planted, level)
        report.value(f"{name}.distance", distances(result, truth))
    # float16 without master gradients: the buckets all-reduce float16 on gloo (widened by the comm layer)
    counters.reset()
    master_gradient_check(report, "fp16_no_master", False, dtype="float16")
    report.value("fp16_no_master.widened", counters.widened_float16())
    checkpoint_resume(report, truth)
    fp32_checkpoint_into_o2(report)
    gloo_float16(report)
    main_grad_refused(report)


if __name__ == "__main__":
    run(main)
