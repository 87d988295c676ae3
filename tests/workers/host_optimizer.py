"""dp_config offload_optimizer on PaddleFormers' Llama, dp2 x sep2 (ring): optimizer_amp's runs (two parameter
groups with their own clip and decay, apply_decay_param_fun, a LinearWarmup schedule, a frozen parameter, 2
accumulated micro-batches per step, a state_dict round trip) at sharding levels 0-3 with the state on the host,
and pp2 x dp2 with the tied embedding on both stages, against one card without offload; what the host holds and
what moved each step; pcp.shard_scaler's skip; a checkpoint saved with offload restored without it and the other
way round (and, on dp2 x mp2, fp32 master weights of a float16 model restored into host memory); a bfloat16
parameter's fp32 master weight stepped on the host against fp32 AdamW; bad settings."""
import os
from unittest import mock

import numpy as np
import paddle
import paddle.distributed as dist
from optimizer_amp import (ACC, build, master_weight_checkpoint, micro_batches, parallel, reference, scaled, train,
                           train_steps, world_mean)
from report import run
from tensor_parallel import WELL_CONDITIONED_EPSILON

import paddle_cp as pcp
from paddle_cp.checkpoint import layout
from paddle_cp.data_parallel.host_optimizer import CpuPlaceHost, HostOptimizer, NumpyHost
from paddle_cp.data_parallel.optimizer import optimizer_parameters

DP2_SEP2 = [("dp", 2), ("sep", 2)]
OFFLOAD = {"offload_optimizer": True}


def stepped(optimizer):
    """The parameters this rank's optimizer steps."""
    return [p for p in optimizer_parameters(optimizer) if layout.steps_here(p) and not p.stop_gradient]


def host_facts(report, name, model, optimizer, scheduler, shard):
    """What the host holds (and that all of the state is there), and what one more step moves each way."""
    host = optimizer.host_optimizer
    params = stepped(optimizer)
    report.value(f"{name}.host", {
        "all_state_on_host": all(host.transport.holds(t) for t in host.state_tensors()),
        "state_tensors": len(host.state_tensors()), "stepped": len(params),
        "host_bytes": host.host_bytes(), "param_bytes": sum(int(np.prod(p.shape)) * 4 for p in params),
        "device_state": sum(1 for t in host.state_tensors() if not host.transport.holds(t))})
    before = dict(host.transport.counts)
    clip = paddle.nn.ClipGradByGlobalNorm._dygraph_clip
    with mock.patch.object(paddle.nn.ClipGradByGlobalNorm, "_dygraph_clip", autospec=True, side_effect=clip) as clips:
        train_steps(model, optimizer, scheduler, list(micro_batches(1)), shard)
    report.value(f"{name}.moved_per_step", {k: v - before[k] for k, v in host.transport.counts.items()})
    report.value(f"{name}.paddle_clips_per_step", clips.call_count)  # clipped once, over all shards, on the device


def offloaded(report, level):
    name = f"offload_l{level}"
    host_facts(report, name, *train(report, name, DP2_SEP2, level=level, sep=True, **OFFLOAD))


def cross_checkpoint(report, save_offload, load_offload, save_level, load_level):
    """Train 3 steps, save; a fresh run (the other offload setting, another level) loads it; both take one more
    step: equal losses and parameters."""
    name = f"checkpoint_{'host' if save_offload else 'device'}_to_{'host' if load_offload else 'device'}"
    saving = parallel(DP2_SEP2, save_level, WELL_CONDITIONED_EPSILON, True, **({} if not save_offload else OFFLOAD))
    _, model, optimizer, scheduler, shard = saving
    batches = list(micro_batches(4))
    train_steps(model, optimizer, scheduler, batches[:3 * ACC], shard)
    path = os.path.join(os.environ["PCP_REPORT_DIR"], name)
    pcp.save_checkpoint(path, model, optimizer)
    saved = pcp.full_state_dict(model)
    loading = parallel(DP2_SEP2, load_level, WELL_CONDITIONED_EPSILON, True, **({} if not load_offload else OFFLOAD))
    _, fresh_model, fresh, fresh_scheduler, fresh_shard = loading
    pcp.load_checkpoint(path, fresh_model, fresh)
    if load_offload:  # before any step: the loaded state is in host memory, none of it on the device
        host = fresh.host_optimizer
        report.value(f"{name}.loaded_on_host", bool(host.state_tensors()) and all(
            host.transport.holds(t) for t in host.state_tensors()))
    for _ in range(3):
        fresh_scheduler.step()  # the script's schedule, resumed
    loaded = pcp.full_state_dict(fresh_model)
    report.diff(f"{name}.loaded", np.concatenate([loaded[k].ravel() for k in saved]),
                np.concatenate([v.ravel() for v in saved.values()]))
    want = train_steps(model, optimizer, scheduler, batches[3 * ACC:], shard)
    got = train_steps(fresh_model, fresh, fresh_scheduler, batches[3 * ACC:], fresh_shard)
    report.diff(f"{name}.loss", np.array([world_mean(x) for x in got]), np.array([world_mean(x) for x in want]))
    after, want_after = pcp.full_state_dict(fresh_model), pcp.full_state_dict(model)
    for key, value in want_after.items():
        report.diff(f"{name}.param", after[key], value)
    if load_offload:
        host = fresh.host_optimizer
        report.value(f"{name}.all_state_on_host", all(host.transport.holds(t) for t in host.state_tensors()))


def master_weights(report, name, transport):
    """bfloat16 parameters with multi_precision AdamW, stepped by HostOptimizer: the host keeps an fp32 master
    (registered where checkpoint/layout.py looks), steps it as fp32 AdamW steps an fp32 copy of the parameter on
    the bfloat16 gradient, and writes back its bfloat16 rounding (CPU has no bfloat16 AdamW kernel to compare).
    `transport`: NumpyHost, or the GPU's CpuPlaceHost run on CPU (its copies are CPU to CPU here)."""
    rng = np.random.RandomState(5)
    values = [rng.randn(*shape).astype("float32") for shape in ((8, 16), (16,))]
    grads = [[rng.randn(*v.shape).astype("float32") for v in values] for _ in range(3)]

    def params(dtype):
        made = []
        for i, value in enumerate(values):
            p = paddle.create_parameter(list(value.shape), "float32", name=f"{name}_{dtype}_{i}")
            p.set_value(paddle.to_tensor(value).astype("bfloat16").astype("float32"))  # bfloat16 values
            made.append(p if dtype == "float32" else paddle.base.framework.EagerParamBase.from_tensor(
                p.astype(dtype), name=p.name))
        return made

    def adamw(ps, multi_precision):
        return paddle.optimizer.AdamW(learning_rate=1e-2, epsilon=1e-3, weight_decay=0.1, parameters=ps,
                                      multi_precision=multi_precision)

    low, full = params("bfloat16"), params("float32")
    host, reference_opt = adamw(low, True), adamw(full, False)
    stepper = HostOptimizer(host, transport)
    for step_grads in grads:
        for p, q, g in zip(low, full, step_grads):
            g16 = paddle.to_tensor(g).astype("bfloat16")
            p._set_grad_ivar(g16)
            q._set_grad_ivar(g16.astype("float32"))
        stepper.step()
        reference_opt.step()
    for p, q in zip(low, full):
        master = layout.state_tensor(host, p, layout.MASTER_WEIGHT)
        report.diff(f"{name}.master", master.numpy(), q.numpy())
        report.diff(f"{name}.param", p.astype("float32").numpy(), q.astype("bfloat16").astype("float32").numpy())
        for state in ("moment1", "moment2"):
            report.diff(f"{name}.moments", layout.state_tensor(host, p, state).numpy(),
                        reference_opt._accumulators[state][q.name].numpy())
    report.value(f"{name}.dtypes", sorted({str(p.dtype) for p in low}))
    report.value(f"{name}.on_host", all(stepper.transport.holds(t) for t in stepper.state_tensors()))
    report.value(f"{name}.moved", stepper.transport.counts)


def bad_settings(report):
    def parallelize(optimizer_of, **dp_config):
        paddle.seed(0)
        model, _, _ = build(WELL_CONDITIONED_EPSILON)
        mesh = dist.ProcessMesh(np.arange(4).reshape([2, 2]).tolist(), dim_names=["dp", "sep"])
        pcp.parallelize(model, optimizer_of(model), mesh, {"dp_config": {"sharding_level": 1, **dp_config}})

    adamw = lambda m: paddle.optimizer.AdamW(parameters=m.parameters())  # noqa: E731
    report.expect_error("bad.not_bool", lambda: parallelize(adamw, offload_optimizer="yes"))
    report.expect_error("bad.lamb", lambda: parallelize(lambda m: paddle.optimizer.Lamb(parameters=m.parameters()),
                                                        offload_optimizer=True))
    report.expect_error("bad.multi_tensor", lambda: parallelize(
        lambda m: paddle.optimizer.Momentum(parameters=m.parameters(), use_multi_tensor=True),
        offload_optimizer=True))


def main(report):
    reference(WELL_CONDITIONED_EPSILON)
    bad_settings(report)
    master_weights(report, "bf16", NumpyHost())
    master_weights(report, "bf16_cpuplace", CpuPlaceHost())
    for level in (0, 1, 2, 3):
        offloaded(report, level)
    train(report, "offload_pp2xdp2_tied", [("pp", 2), ("dp", 2)], **OFFLOAD)  # each stage steps its own
    scaled(report, "offload_scaler_l2", DP2_SEP2, 2, sep=True, **OFFLOAD)
    cross_checkpoint(report, True, False, 2, 1)
    cross_checkpoint(report, False, True, 3, 2)
    master_weight_checkpoint(report, "master_weights_to_host", [("dp", 2), ("mp", 2)], 2, **OFFLOAD)


if __name__ == "__main__":
    run(main)
