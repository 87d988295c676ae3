"""The optimizer and AMP calls of Paddle's parallel-API scripts, on a PaddleFormers Llama, vs one card.

Every run: two parameter groups each with its own ClipGradByGlobalNorm and weight decay,
`apply_decay_param_fun`, a LinearWarmup schedule stepped by the script, a frozen parameter
left in the parameter list, gradient accumulation by the script (loss / ACC, `step()` every
ACC micro-batches), `paddle.amp.decorate` called after parallelize (CPU: Paddle returns the
objects as they are). Measured: losses, the accumulated gradients of the first step, the
learning rates, the parameters after STEPS steps; how many gradient reductions each step
made; an `optimizer.state_dict()` / `set_state_dict` round trip that replays a step exactly.
Meshes: dp2 x mp2 at sharding levels 0, 2, 3 (and with Adam's default epsilon, against one
card's rounding spread), sep2 x dp2, pp2 x dp2 (tied embedding on both stages). The scaler runs
drive Paddle's GradScaler (enabled on CPU by construction, `cpu_scaler`) through
`pcp.shard_scaler` (dp2 x sep2 at level 2, sharded over all four ranks; dp2 x mp2 at level 3),
then inject an inf on one rank. The master-weight runs save and load the
fp32 master weights of a model cast as decorate O2 casts it.
"""
import copy
import os
import sys
import zlib
from unittest import mock

import numpy as np
import paddle
import paddle.amp.grad_scaler as grad_scaler
import paddle.distributed as dist
from report import run
from tensor_parallel import CP_PLAN, DEFAULT_EPSILON, JITTER_SEEDS, WELL_CONDITIONED_EPSILON, _jitter, full_gradients
from tensor_parallel import paddle_plan

import paddle_cp as pcp
from paddle_cp.comm import collectives

BATCH, SEQ, ACC, STEPS = 4, 16, 2, 3
CLIPS = (0.05, 0.02)  # below the groups' gradient norms: both clips bind
FROZEN = "model.layers.0.mlp.up_proj.weight"
INF_PARAM = "model.layers.0.self_attn.q_proj.weight"  # split over mp: only some ranks hold the inf
REDUCTION_TAGS = ("grad_all_reduce", "grad_reduce_scatter")
# pipeline: its own micro-batches (2) inside each of the script's micro-batches
PP_CONFIG = {"split_spec": "model.layers", "global_spec": "model.rotary_emb", "schedule_mode": "1F1B",
             "accumulate_steps": 2}


def llama():
    """A tiny PaddleFormers Llama with the config's defaults (eager attention, tied embedding and lm_head),
    but the fused norm (no CPU kernel)."""
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False))


def build(epsilon):
    paddle.seed(2024)
    model = llama()
    named = dict(model.named_parameters())
    named[FROZEN].stop_gradient = True
    no_decay = {p.name for n, p in named.items() if "embed" in n}
    scheduler = paddle.optimizer.lr.LinearWarmup(learning_rate=1e-2, warmup_steps=2, start_lr=2e-3, end_lr=1e-2)
    optimizer = paddle.optimizer.AdamW(
        learning_rate=scheduler, epsilon=epsilon, apply_decay_param_fun=lambda name: name not in no_decay,
        parameters=[
            {"params": [p for n, p in named.items() if "norm" not in n], "weight_decay": 0.1,
             "grad_clip": paddle.nn.ClipGradByGlobalNorm(CLIPS[0])},
            {"params": [p for n, p in named.items() if "norm" in n], "weight_decay": 0.05, "learning_rate": 3.0,
             "grad_clip": paddle.nn.ClipGradByGlobalNorm(CLIPS[1])}])
    return model, optimizer, scheduler


def micro_batches(steps=STEPS):
    rng = np.random.RandomState(11)
    for _ in range(steps * ACC):
        yield tuple(paddle.to_tensor(rng.randint(0, 128, [BATCH, SEQ]), dtype="int64") for _ in range(2))


def cpu_scaler(**kwargs):
    """Paddle's GradScaler with its GPU logic enabled on CPU (it disables itself on a CPU place): the
    scale, unscale, found-inf and skip decisions Paddle makes on GPU. The forward must run under
    `paddle.amp.auto_cast(dtype="float16")` (a no-op on CPU) or the scaler disables itself again."""
    class GpuPlace:
        @staticmethod
        def is_gpu_place():
            return True

    class Tracer:
        _expected_place = GpuPlace()

    with mock.patch.object(grad_scaler, "_dygraph_tracer", Tracer):
        # decr_every_n_nan_or_inf=2: Paddle 3.3.1's update() crashes under numpy 2 when it decreases
        # the scale (float() of a shape-[1] tensor in its message); one inf only counts here
        return paddle.amp.GradScaler(init_loss_scaling=1024, decr_every_n_nan_or_inf=2, **kwargs)


def train_steps(model, optimizer, scheduler, batches, shard=None, scaler=None, before_step=None):
    """Script-style training: loss / ACC per micro-batch, a step every ACC micro-batches, the schedule
    stepped after it. Returns each step's loss (sum of its micro-batches' mean losses)."""
    losses, total = [], 0.0
    for index, (ids, labels) in enumerate(batches, start=1):
        if shard is not None:
            ids, labels = shard(ids, labels)
        with paddle.amp.auto_cast(scaler is not None, level="O1", dtype="float16"):
            loss = model(input_ids=ids, labels=labels)[0] / ACC
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total += float(loss)
        if index % ACC:
            continue
        if before_step is not None:
            before_step(len(losses))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.clear_grad()
        scheduler.step()
        losses.append(total)
        total = 0.0
    return losses


def one_card(epsilon, scaler=None, jitter_seed=None):
    """Losses, the first step's accumulated gradients, the learning rates and the final state of one card."""
    model, optimizer, scheduler = build(epsilon)
    if jitter_seed is not None:
        _jitter(model, jitter_seed)
    names = {id(p): n for n, p in model.named_parameters()}
    grads, rates = {}, []

    def record(step):
        rates.append(optimizer.get_lr())
        if step == 0:
            grads.update({names[id(p)]: p.grad.numpy() for p in model.parameters() if p.grad is not None})

    losses = train_steps(model, optimizer, scheduler, micro_batches(), scaler=scaler, before_step=record)
    return np.array(losses), grads, rates, {k: v.numpy() for k, v in model.state_dict().items()}


_references = {}


def reference(epsilon, scaled=False, jitter_seed=None):
    key = (epsilon, scaled, jitter_seed)
    if key not in _references:
        _references[key] = one_card(epsilon, cpu_scaler() if scaled else None, jitter_seed)
    return _references[key]


def rounding_spread(epsilon):
    """What fp32 rounding alone does: one card vs itself started one ulp away (JITTER_SEEDS)."""
    losses, _, _, state = reference(epsilon)
    spread = {"loss": 0.0, "state": 0.0}
    for seed in JITTER_SEEDS:
        other_losses, _, _, other = reference(epsilon, jitter_seed=seed)
        spread["loss"] = max(spread["loss"], float(np.abs(other_losses - losses).max()))
        spread["state"] = max(spread["state"], max(float(np.abs(other[k] - v).max()) for k, v in state.items()))
    return spread


class ReductionCounter:
    """Counts the optimizer's gradient reductions (collectives with REDUCTION_TAGS)."""

    def __init__(self):
        self.count = 0
        self._patches = [mock.patch.object(collectives, name, self._counted(getattr(collectives, name)))
                         for name in ("all_reduce", "reduce_scatter")]

    def _counted(self, fn):
        def counted(group, tensor, tag=None, **kwargs):
            self.count += tag in REDUCTION_TAGS
            return fn(group, tensor, tag=tag, **kwargs)
        return counted

    def __enter__(self):
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc):
        for patch in self._patches:
            patch.stop()


def parallelized(dims, level, epsilon, sep, **dp_config):
    """(mesh, model, optimizer, scheduler): build(epsilon)'s on a mesh of `dims` ((name, size) pairs) at sharding
    `level`, Paddle's mp plan where mp > 1, the pipeline where pp is a dim, ring attention when `sep`."""
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(np.arange(world).reshape([d for _, d in dims]).tolist(), dim_names=[n for n, _ in dims])
    model, optimizer, scheduler = build(epsilon)
    config = {"dp_config": {"sharding_level": level, **dp_config}}
    if "pp" in dict(dims):
        config["pp_config"] = PP_CONFIG
    if dict(dims).get("mp", 1) > 1:
        config["mp_config"] = {"parallelize_plan": paddle_plan(model)}
    if sep:
        config["cp_config"] = {"parallelize_plan": CP_PLAN}
    model, optimizer = pcp.parallelize(model, optimizer, mesh=mesh, config=config)
    return mesh, model, optimizer, scheduler


def parallel(dims, level, epsilon, sep, **dp_config):
    mesh, model, wrapper, scheduler = parallelized(dims, level, epsilon, sep, **dp_config)
    model, optimizer = paddle.amp.decorate(models=model, optimizers=wrapper, level="O2", dtype="bfloat16",
                                           master_grad=True)  # CPU: returned as given (GPU: see the docs)
    assert optimizer is wrapper

    def shard(ids, labels):
        ids, labels = pcp.shard_batch((ids, labels), mesh=mesh)
        return ids, (pcp.shard_sequence(labels, mesh=mesh) if sep else labels)

    return mesh, model, optimizer, scheduler, shard


def world_mean(value):
    total = paddle.to_tensor(value, dtype="float32")
    dist.all_reduce(total)  # mp copies are equal: the world mean is the dp x sep mean
    return float(total) / dist.get_world_size()


def train(report, name, dims, level=0, epsilon=WELL_CONDITIONED_EPSILON, sep=False, **dp_config):
    mesh, model, optimizer, scheduler, shard = parallel(dims, level, epsilon, sep, **dp_config)
    want_losses, want_grads, want_rates, want_state = reference(epsilon)
    rates = []

    def check_step(step):
        rates.append(optimizer.get_lr())
        if step == 0 and level == 0:  # the accumulated gradients, reduced once, are one card's
            optimizer.reduce_gradients()
            for key, grad in full_gradients(model).items():
                report.diff(f"{name}.step1.grad", grad, want_grads[key])
            report.value(f"{name}.frozen_has_grad", dict(model.named_parameters())[FROZEN].grad is not None)

    with ReductionCounter() as counter:
        losses = train_steps(model, optimizer, scheduler, micro_batches(), shard, before_step=check_step)
    report.value(f"{name}.reductions", counter.count)  # one per step: none per micro-batch, none twice
    report.diff(f"{name}.loss", np.array([world_mean(x) for x in losses]), want_losses)
    report.diff(f"{name}.lr", np.array(rates), np.array(want_rates))
    state = pcp.full_state_dict(model)
    report.value(f"{name}.state_keys_match", sorted(state) == sorted(want_state))
    for key, value in want_state.items():
        report.diff(f"{name}.param", state.get(key, np.zeros([0])), value)
    report.value(f"{name}.frozen_unchanged", bool(np.array_equal(state[FROZEN], want_state[FROZEN])))
    if epsilon == DEFAULT_EPSILON:
        report.value(f"{name}.rounding_spread", rounding_spread(epsilon))
    report.value(f"{name}.state_dict_round_trip", state_dict_round_trip(model, optimizer, scheduler, shard))
    return model, optimizer, scheduler, shard


def state_dict_round_trip(model, optimizer, scheduler, shard):
    """Take a step, put the parameters and `optimizer.state_dict()` of before it back with
    `set_state_dict`, take it again: largest difference of parameters and optimizer state (0 = exact)."""
    held = [p for p in model.parameters() if p._is_initialized()]  # pipeline: this stage's

    def snapshot():
        return ([p.numpy().copy() for p in held],
                {k: (v.numpy().copy() if isinstance(v, paddle.Tensor) else copy.deepcopy(v))
                 for k, v in optimizer.state_dict().items()})

    def one_more_step():
        train_steps(model, optimizer, scheduler, list(micro_batches(STEPS + 1))[-ACC:], shard)
        return snapshot()

    params, state = snapshot()
    lr = optimizer.get_lr()
    params_a, state_a = one_more_step()
    for p, value in zip(held, params):
        p.set_value(value)
    optimizer.set_state_dict({k: (paddle.to_tensor(v) if isinstance(v, np.ndarray) else copy.deepcopy(v))
                              for k, v in state.items()})
    restored_lr = optimizer.get_lr()
    params_b, state_b = one_more_step()
    tensors = [k for k, v in state_a.items() if isinstance(v, np.ndarray)]
    return {"lr_restored": restored_lr == lr, "state_keys": len(tensors),
            "params": max(_max_abs(a, b) for a, b in zip(params_a, params_b)),
            "state": max(_max_abs(state_a[k], state_b[k]) for k in tensors),
            "scheduler": state_a.get("LR_Scheduler") == state_b.get("LR_Scheduler")}


def _max_abs(a, b):
    return float(np.abs(a - b).max()) if a.size else 0.0  # level 3: empty placeholders


def inject_inf(model, optimizer):
    """An inf in this rank's gradient of INF_PARAM (at level 3 a non-owner stashes it for the reduce-scatter)."""
    param = dict(model.named_parameters())[INF_PARAM]
    stash = optimizer._sharding._stash if optimizer._sharding is not None else {}
    grad = stash.get(id(param), param.grad)
    value = grad.numpy()
    value.flat[0] = np.inf
    paddle.assign(paddle.to_tensor(value), grad)


def scaler_step(model, optimizer, scaler, shard, inject=True):
    """One micro-batch, with an inf in one gradient on rank 0 only if `inject`, then the scaler's step and
    update: {changed: largest parameter change anywhere in the model (0 = every rank skipped), ...}."""
    before = pcp.full_state_dict(model)
    ids, labels = shard(*next(iter(micro_batches(1))))
    with paddle.amp.auto_cast(True, level="O1", dtype="float16"):
        loss = model(input_ids=ids, labels=labels)[0]
    scaler.scale(loss).backward()
    if inject and dist.get_rank() == 0:
        inject_inf(model, optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.clear_grad()
    after = pcp.full_state_dict(model)
    return {"changed": max(float(np.abs(after[k] - v).max()) for k, v in before.items()),
            "found_inf": bool(scaler._cache_found_inf), "decr_count": scaler._decr_count,
            "scale": float(scaler._scale.numpy()[0])}


def scaled(report, name, dims, level, sep=False, **dp_config):
    """GradScaler through pcp.shard_scaler: STEPS steps vs one card with the same scaler logic; then
    an inf on one rank: every rank skips, and the next finite step steps. Controls: agreement switched
    off (ranks then disagree), and a scaler without shard_scaler (a clear error)."""
    mesh, model, optimizer, scheduler, shard = parallel(dims, level, WELL_CONDITIONED_EPSILON, sep, **dp_config)
    scaler = pcp.shard_scaler(cpu_scaler())
    want_losses, _, _, want_state = reference(WELL_CONDITIONED_EPSILON, scaled=True)
    losses = train_steps(model, optimizer, scheduler, micro_batches(), shard, scaler=scaler)
    report.diff(f"{name}.loss", np.array([world_mean(x) for x in losses]), want_losses)
    state = pcp.full_state_dict(model)
    for key, value in want_state.items():
        report.diff(f"{name}.param", state[key], value)
    report.value(f"{name}.scale_after_steps", float(scaler._scale.numpy()[0]))
    report.value(f"{name}.inf_agreed", scaler_step(model, optimizer, scaler, shard))
    report.value(f"{name}.step_after_skip", scaler_step(model, optimizer, scaler, shard, inject=False))
    optimizer.agree_found_inf = lambda found_inf: found_inf  # control: each rank decides alone
    report.value(f"{name}.inf_not_agreed", scaler_step(model, optimizer, scaler, shard))
    del optimizer.agree_found_inf
    report.expect_error(f"{name}.unsharded_scaler", lambda: scaler_step(model, optimizer, cpu_scaler(), shard))
    optimizer.clear_grad()


def master_weight_checkpoint(report, name, dims, level, **load_dp_config):
    """Checkpoints carry fp32 master weights: the model cast as decorate(level="O2", dtype="float16") casts
    it on GPU (Paddle's amp_initialize), an AdamW with multi_precision, its state created as its first step
    creates it (no CPU kernel steps float16 AdamW) and filled with known single-card values; saved, then
    loaded into a freshly built, parallelized and cast model and optimizer (`load_dp_config` added to its
    dp_config): every rank's master weights and moments are its slices of the known values; the files hold `{param}.w_0` in float32 at the full shape."""
    from paddle.amp.auto_cast import amp_initialize

    from paddle_cp.checkpoint import layout
    from paddle_cp.checkpoint.format import global_specs, read_metadata
    from paddle_cp.params import find_record

    def build_cast(**dp_config):
        _, model, optimizer, _, _ = parallel(dims, level, WELL_CONDITIONED_EPSILON, sep=False, **dp_config)
        amp_initialize(models=[model], dtype="float16", excluded_layers=None)
        optimizer._multi_precision = True  # what decorate's _set_multi_precision does, through the wrapper
        return model, optimizer

    def known(key, name, param):
        shape = [1] if name in layout.SCALAR_ACCUMULATORS else list(layout.global_shape(param))
        full = np.random.RandomState(zlib.crc32(f"{key}.{name}".encode())).rand(*shape).astype("float32") + 1e-4
        record = find_record(param)
        scalar_or_whole = name in layout.SCALAR_ACCUMULATORS or record is None or not record.shards()
        return full if scalar_or_whole else record.local(full)

    def states(model, optimizer):
        return [(key, name, param) for key, param in model.named_parameters() if layout.steps_here(param)
                for name in layout.state_names(optimizer, param)]

    model, optimizer = build_cast()
    mine = [p for _, p in model.named_parameters() if layout.steps_here(p) and not p.stop_gradient]
    optimizer.inner._create_accumulators(paddle.static.default_main_program().global_block(), mine)
    for key, state, param in states(model, optimizer):
        if layout.state_tensor(optimizer, param, state) is not None:
            layout.state_tensor(optimizer, param, state).set_value(known(key, state, param))
    path = os.path.join(os.environ["PCP_REPORT_DIR"], name)
    pcp.save_checkpoint(path, model, optimizer)

    fresh_model, fresh = build_cast(**load_dp_config)  # `load_dp_config`: e.g. the state loaded into host memory
    pcp.load_checkpoint(path, fresh_model, fresh)
    masters = 0
    for key, state, param in states(fresh_model, fresh):
        tensor = layout.state_tensor(fresh, param, state)
        if param.stop_gradient:
            report.value(f"{name}.frozen_state_{key}.{state}", tensor is not None)
            continue
        masters += state == layout.MASTER_WEIGHT
        report.diff(f"{name}.state", tensor.numpy(), known(key, state, param))
    report.value(f"{name}.master_weights_here", masters)
    if fresh.host_optimizer is not None:
        host = fresh.host_optimizer
        report.value(f"{name}.state_on_host", all(host.transport.holds(t) for t in host.state_tensors()))
    specs = global_specs(read_metadata(os.path.join(path, "optimizer_state")))
    report.value(f"{name}.saved_master_weights", sorted(
        (k, list(shape), dtype) for k, (shape, dtype) in specs.items() if k.endswith(".w_0")))
    report.value(f"{name}.model_dtypes", sorted({layout.dtype_name(p.dtype) for p in fresh_model.parameters()}))


DP2_MP2 = [("dp", 2), ("mp", 2)]
RUNS = {
    "groups": [
        lambda r: train(r, "dp2xmp2_l0", DP2_MP2, level=0),
        lambda r: train(r, "dp2xmp2_l2", DP2_MP2, level=2),
        lambda r: train(r, "dp2xmp2_l3", DP2_MP2, level=3),
        lambda r: train(r, "sep2xdp2", [("dp", 2), ("sep", 2)], sep=True),
        lambda r: train(r, "pp2xdp2_tied", [("pp", 2), ("dp", 2)]),  # the tied weight on both stages
        lambda r: train(r, "dp2xmp2_default_eps", DP2_MP2, epsilon=DEFAULT_EPSILON),
        lambda r: scaled(r, "scaler_dp2xsep2_l2", [("dp", 2), ("sep", 2)], level=2, sep=True),  # sharded over 4
        lambda r: scaled(r, "scaler_dp2xmp2_l3", DP2_MP2, level=3),
        lambda r: master_weight_checkpoint(r, "master_weights_dp2xmp2_l2", DP2_MP2, level=2),
        lambda r: master_weight_checkpoint(r, "master_weights_dp2xmp2_l3", DP2_MP2, level=3),
    ],
}


def main(report):
    for spec in RUNS[sys.argv[1]]:
        spec(report)


if __name__ == "__main__":
    run(main)
