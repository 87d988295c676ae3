"""HostOptimizer (dp_config offload_optimizer) in one process: each optimizer paddle_cp steps on the host gives
exactly Paddle's own step, its state lives outside Paddle's allocator, and a state_dict round trip keeps it there.
(Multi-rank runs, checkpoints and the Trainer: tests/multiproc/test_host_optimizer.py.)"""
import numpy as np
import paddle
import pytest

from paddle_cp.data_parallel.host_optimizer import HostOptimizer, check_offloadable
from paddle_cp.tools.allocator import allocated

STEPS = 3


def _groups(params):
    """Two groups, the second with its own learning rate, decay and beta1; decay off for biases."""
    return dict(apply_decay_param_fun=lambda name: "b_" not in name,
                parameters=[{"params": params[:2], "weight_decay": 0.1},
                            {"params": params[2:], "weight_decay": 0.05, "learning_rate": 3.0, "beta1": 0.8}])


OPTIMIZERS = {
    "adamw_groups_schedule": lambda ps: paddle.optimizer.AdamW(paddle.optimizer.lr.LinearWarmup(
        learning_rate=1e-2, warmup_steps=2, start_lr=2e-3, end_lr=1e-2), epsilon=1e-3, **_groups(ps)),
    "adam_l2": lambda ps: paddle.optimizer.Adam(1e-2, parameters=ps, weight_decay=0.01, epsilon=1e-3),
    "adam_amsgrad": lambda ps: paddle.optimizer.Adam(1e-2, parameters=ps, amsgrad=True, epsilon=1e-3),
    "momentum_nesterov_l2": lambda ps: paddle.optimizer.Momentum(1e-2, parameters=ps, use_nesterov=True,
                                                                weight_decay=0.01),
    "sgd_l2": lambda ps: paddle.optimizer.SGD(1e-2, parameters=ps, weight_decay=0.01),
}


def _train(make, host):
    paddle.seed(1)
    model = paddle.nn.Sequential(paddle.nn.Linear(16, 64), paddle.nn.Linear(64, 4))
    optimizer = make(model.parameters())
    stepper = HostOptimizer(optimizer) if host else optimizer
    x = paddle.to_tensor(np.random.RandomState(0).randn(8, 16).astype("float32"))
    grown = []
    for _ in range(STEPS):
        model(x).square().mean().backward()
        before = allocated()
        stepper.step()
        grown.append(allocated() - before)
        optimizer.clear_grad()
        if isinstance(optimizer._learning_rate, paddle.optimizer.lr.LRScheduler):
            optimizer._learning_rate.step()
    return model, optimizer, stepper, grown


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_host_step_is_paddles_step_with_the_state_outside_the_allocator(name):
    model, _, _, _ = _train(OPTIMIZERS[name], host=False)
    host_model, optimizer, stepper, grown = _train(OPTIMIZERS[name], host=True)
    for want, got in zip(model.parameters(), host_model.parameters()):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    state = stepper.state_tensors()
    assert all(stepper.transport.holds(t) for t in state)
    assert stepper.host_bytes() == sum(t.numel().item() * 4 for t in state)
    assert max(grown) < 64, grown  # the state is in numpy memory: the allocator does not grow by it
    if name != "sgd_l2":
        assert stepper.host_bytes() >= sum(p.numel().item() * 4 for p in host_model.parameters())


def test_set_state_dict_keeps_the_state_on_the_host_and_replays_a_step():
    model, optimizer, stepper, _ = _train(OPTIMIZERS["adam_l2"], host=True)
    params = [p.numpy().copy() for p in model.parameters()]
    saved = {k: v.numpy().copy() if isinstance(v, paddle.Tensor) else v for k, v in optimizer.state_dict().items()}
    x = paddle.to_tensor(np.random.RandomState(1).randn(8, 16).astype("float32"))

    def step():
        model(x).square().mean().backward()
        stepper.step()
        optimizer.clear_grad()
        return [p.numpy().copy() for p in model.parameters()]

    first = step()
    for p, value in zip(model.parameters(), params):
        p.set_value(value)
    optimizer.set_state_dict({k: paddle.to_tensor(v) if isinstance(v, np.ndarray) else v for k, v in saved.items()})
    stepper.rehome()  # what ParallelOptimizer.set_state_dict does after Paddle's
    assert all(stepper.transport.holds(t) for t in stepper.state_tensors())
    for want, got in zip(first, step()):
        np.testing.assert_array_equal(got, want)


def test_optimizers_without_a_host_step_are_refused_with_the_fix():
    params = paddle.nn.Linear(2, 2).parameters()
    with pytest.raises(ValueError, match="not Lamb: use one of those, or set offload_optimizer False"):
        check_offloadable(paddle.optimizer.Lamb(parameters=params))

    class OwnUpdate(paddle.optimizer.AdamW):  # as PaddleFormers' AdamWMini: its own update, unchecked on the host
        def _append_optimize_op(self, block, param_and_grad):
            return None

    with pytest.raises(ValueError, match=r"not OwnUpdate \(it replaces AdamW's update"):
        check_offloadable(OwnUpdate(parameters=params))
    check_offloadable(type("Renamed", (paddle.optimizer.AdamW,), {})(parameters=params))  # same update: accepted
    with pytest.raises(ValueError, match="use_multi_tensor=False"):
        check_offloadable(paddle.optimizer.Adam(parameters=params, use_multi_tensor=True))


def test_float16_master_weights_survive_a_state_dict_round_trip():
    """float16 parameters, multi_precision AdamW, gradients given (no float16 matmul on CPU): after set_state_dict
    (whose master weights are new tensors) the host steps the loaded masters and replays a step exactly."""
    rng = np.random.RandomState(3)
    params = [paddle.base.framework.EagerParamBase.from_tensor(
        paddle.to_tensor(rng.randn(*shape).astype("float16")), name=f"fp16_round_trip_{i}")
        for i, shape in enumerate(((4, 8), (8,)))]
    optimizer = paddle.optimizer.AdamW(1e-2, parameters=params, multi_precision=True, epsilon=1e-3,
                                       apply_decay_param_fun=lambda name: name.startswith("fp16_round_trip_0"))
    stepper = HostOptimizer(optimizer)
    grads = [[paddle.to_tensor(rng.randn(*p.shape).astype("float16")) for p in params] for _ in range(3)]

    def step(index):
        for p, g in zip(params, grads[index]):
            p._set_grad_ivar(g)
        stepper.step()
        return [p.numpy().copy() for p in params]

    step(0)
    step(1)
    values = [p.numpy().copy() for p in params]
    saved = optimizer.state_dict()
    saved = {k: ({n: t.numpy().copy() for n, t in v.items()} if k == "master_weights" else v.numpy().copy())
             for k, v in saved.items()}
    first = step(2)
    assert all(not np.array_equal(a, b) for a, b in zip(first, values))
    for p, value in zip(params, values):
        p.set_value(value)
    optimizer.set_state_dict({k: ({n: paddle.to_tensor(a) for n, a in v.items()} if k == "master_weights"
                                  else paddle.to_tensor(v)) for k, v in saved.items()})
    stepper.rehome()
    assert all(stepper.transport.holds(t) for t in stepper.state_tensors())
    for want, got in zip(first, step(2)):
        np.testing.assert_array_equal(got, want)


def test_a_skipped_step_creates_the_state_as_paddles_does_and_updates_nothing():
    """A GradScaler's found inf: Paddle's step skips the update but creates the state (a checkpoint then holds
    it, zeros); the host step too, without copying anything back."""
    states = {}
    for host in (False, True):
        paddle.seed(1)
        model = paddle.nn.Linear(4, 2)
        optimizer = paddle.optimizer.AdamW(1e-2, parameters=model.parameters(), epsilon=1e-3)
        stepper = HostOptimizer(optimizer) if host else optimizer
        before = [p.numpy().copy() for p in model.parameters()]
        model(paddle.ones([3, 4])).sum().backward()
        optimizer._set_auxiliary_var("found_inf", paddle.to_tensor(True))
        stepper.step()
        for want, p in zip(before, model.parameters()):
            np.testing.assert_array_equal(p.numpy(), want)
        layer = model.weight.name.split(".")[0]  # the two models' parameters differ by their layer's name
        states[host] = {k.replace(layer, "linear"): v.numpy() for k, v in optimizer.state_dict().items()
                        if isinstance(v, paddle.Tensor)}
        if host:
            assert stepper.transport.counts["to_device"] == 0
            assert stepper.state_tensors() and all(stepper.transport.holds(t) for t in stepper.state_tensors())
    assert sorted(states[True]) == sorted(states[False]) and len(states[True]) == 8  # 2 params x 4 accumulators
    for key, value in states[False].items():
        np.testing.assert_array_equal(states[True][key], value)


def test_settings_the_host_step_would_compute_otherwise_are_refused_with_the_fix():
    params = paddle.nn.Linear(2, 2).parameters()
    adamw = paddle.optimizer.AdamW(parameters=params)
    adamw._lr_ratio = lambda p: 0.5  # what a GPU build accepts (Paddle refuses lr_ratio on CPU builds)
    with pytest.raises(ValueError, match="does not apply lr_ratio to the update"):
        check_offloadable(adamw)
    low = [paddle.base.framework.EagerParamBase.from_tensor(p.astype("bfloat16"), name=p.name + "_bf16")
           for p in params]
    with pytest.raises(ValueError, match="build Momentum with multi_precision=True"):
        check_offloadable(paddle.optimizer.Momentum(parameters=low))
    check_offloadable(paddle.optimizer.Momentum(parameters=low, multi_precision=True))
    check_offloadable(paddle.optimizer.AdamW(parameters=low))  # Adam's state of a bf16 parameter is fp32 anyway


def test_a_paddle_state_dict_keyed_by_master_names_is_refused_by_an_offloaded_optimizer():
    """Saved without offload, a multi_precision optimizer's accumulators are keyed by Paddle's fp32 master names,
    which an offloaded optimizer never asks for (its masters are named as their parameters): refused, naming the
    checkpoint functions that move state between the settings."""
    from paddle_cp.data_parallel.optimizer import ParallelOptimizer

    param = paddle.base.framework.EagerParamBase.from_tensor(paddle.ones([2, 2]).astype("bfloat16"), name="w_bf16")
    device = paddle.optimizer.AdamW(parameters=[param], multi_precision=True)
    master = device._create_master_weight(param)
    device._add_accumulator("moment1", master)
    saved = device.state_dict()
    assert any("_fp32_master_" in key for key in saved)
    inner = paddle.optimizer.AdamW(parameters=[param], multi_precision=True)
    offloaded = ParallelOptimizer(inner, world=None, host=HostOptimizer(inner))
    with pytest.raises(ValueError, match="pcp.save_checkpoint and pcp.load_checkpoint"):
        offloaded.set_state_dict(saved)
