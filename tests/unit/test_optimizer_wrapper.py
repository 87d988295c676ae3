"""The optimizer parallelize returns, in one process: everything but its own step is the inner
optimizer's (read and written), so what paddle.amp.decorate and GradScaler touch reaches Paddle's
optimizer; master weights go into checkpoints and come back."""
import numpy as np
import paddle
import paddle.distributed as dist
import pytest
from paddle.amp.auto_cast import _set_multi_precision, check_optimizers

import paddle_cp as pcp
from paddle_cp.checkpoint import layout
from paddle_cp.data_parallel.optimizer import ParallelOptimizer


def _wrapped(**kwargs):
    layer = paddle.nn.Linear(3, 2)
    scheduler = paddle.optimizer.lr.LinearWarmup(learning_rate=0.1, warmup_steps=2, start_lr=0.01, end_lr=0.1)
    inner = paddle.optimizer.AdamW(learning_rate=scheduler, parameters=layer.parameters(), **kwargs)
    return layer, scheduler, inner, ParallelOptimizer(inner, world=None)


def test_attributes_are_the_inner_optimizers_read_and_written():
    _, scheduler, inner, optimizer = _wrapped()
    assert isinstance(optimizer, paddle.optimizer.Optimizer)  # decorate's and Trainer's checks
    assert optimizer.inner is inner and optimizer._parameter_list is inner._parameter_list
    optimizer._multi_precision = True  # what amp.decorate's _set_multi_precision does
    assert inner._multi_precision is True and "_multi_precision" not in vars(optimizer)
    assert optimizer.get_lr() == pytest.approx(0.01)
    scheduler.step()
    assert optimizer.get_lr() == pytest.approx(scheduler()) == inner.get_lr()
    assert optimizer.state_dict()["LR_Scheduler"] == inner.state_dict()["LR_Scheduler"]


def test_set_lr_reaches_the_inner_optimizer():
    layer = paddle.nn.Linear(3, 2)
    inner = paddle.optimizer.AdamW(learning_rate=0.1, parameters=layer.parameters())
    optimizer = ParallelOptimizer(inner, world=None)
    optimizer.set_lr(0.25)
    assert inner.get_lr() == pytest.approx(0.25) and optimizer.get_lr() == pytest.approx(0.25)


def test_amp_decorate_keeps_and_configures_the_wrapper():
    """O1/CPU: decorate returns the objects it was given; the checks and setters of its GPU O2 path
    (read from Paddle 3.3.1's amp_decorate) accept the wrapper and reach the inner optimizer."""
    layer, _, inner, optimizer = _wrapped()
    for level in ("O1", "O2"):
        model, decorated = paddle.amp.decorate(models=layer, optimizers=optimizer, level=level, dtype="bfloat16",
                                               master_grad=True)
        assert model is layer and decorated is optimizer
    check_optimizers([optimizer])
    _set_multi_precision(optimizer, True)
    assert inner._multi_precision is True


def test_shard_scaler_checks_its_argument_and_is_idempotent():
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024)
    assert pcp.shard_scaler(scaler) is scaler and pcp.shard_scaler(scaler) is scaler
    with pytest.raises(TypeError, match="GradScaler"):
        pcp.shard_scaler(object())


def test_master_weights_round_trip_through_a_checkpoint(tmp_path):
    """fp16 parameters with multi_precision: the fp32 master weights (not recoverable from the fp16
    values) are saved as `{param}.w_0` and restored; moments keyed by the master weight too. Built by
    creating the state (no CPU kernel steps fp16 AdamW)."""
    def build():
        paddle.seed(3)
        layer = paddle.nn.Linear(4, 3)
        layer.to(dtype="float16")
        inner = paddle.optimizer.AdamW(parameters=layer.parameters(), multi_precision=True)
        inner._create_accumulators(paddle.static.default_main_program().global_block(), layer.parameters())
        return layer, inner

    layer, inner = build()
    rng = np.random.RandomState(0)
    want = {}
    for key, param in layer.named_parameters():
        for name in layout.state_names(inner, param):
            tensor = layout.state_tensor(inner, param, name)
            value = (rng.rand(*tensor.shape) + 1e-4).astype("float32")  # finer than fp16 can hold
            tensor.set_value(value)
            want[f"{key}.{name}_0"] = value
    assert sorted(k for k in want if k.endswith(".w_0")) == ["bias.w_0", "weight.w_0"]
    pcp.save_checkpoint(str(tmp_path / "c"), layer, inner)
    saved = dist.load_merged_state_dict(str(tmp_path / "c" / "optimizer_state"))
    assert sorted(saved) == sorted(want)
    assert str(saved["weight.w_0"].dtype) in ("paddle.float32", "float32")

    fresh_layer = paddle.nn.Linear(4, 3)
    fresh_layer.to(dtype="float16")
    fresh = paddle.optimizer.AdamW(parameters=fresh_layer.parameters(), multi_precision=True)
    pcp.load_checkpoint(str(tmp_path / "c"), fresh_layer, fresh)
    for key, param in fresh_layer.named_parameters():
        for name in layout.state_names(fresh, param):
            np.testing.assert_array_equal(layout.state_tensor(fresh, param, name).numpy(), want[f"{key}.{name}_0"])

    plain_layer = paddle.nn.Linear(4, 3)
    plain_layer.to(dtype="float16")
    plain = paddle.optimizer.AdamW(parameters=plain_layer.parameters())
    with pytest.raises(ValueError, match="keys only in the checkpoint"):
        pcp.load_checkpoint(str(tmp_path / "c"), plain_layer, plain)


def test_gradients_are_reduced_in_one_dtype_on_every_rank_under_master_grad():
    """decorate(master_grad=True) makes Paddle cast float16/bfloat16 gradients to float32 at the end of
    backward; zeros made for a missing gradient and level-3 stashed gradients must match that dtype, or
    ranks would reduce buffers of different dtypes and sizes."""
    from paddle.amp.auto_cast import amp_global_state

    from paddle_cp.data_parallel.optimizer import gradient_dtype

    low = paddle.zeros([2], "float16")
    assert gradient_dtype(low) == paddle.float16 and gradient_dtype(paddle.zeros([2])) == paddle.float32
    amp_global_state().use_master_grad = True
    try:
        assert gradient_dtype(low) == paddle.float32
        assert gradient_dtype(paddle.zeros([2], "bfloat16")) == paddle.float32
    finally:
        amp_global_state().use_master_grad = False


def test_minimize_steps_on_the_gradients_backward_made_as_paddle_does():
    """Paddle's dygraph usage is `loss.backward(); optimizer.minimize(loss)`: one backward, one step."""
    def trained(wrap):
        paddle.seed(5)
        layer = paddle.nn.Linear(3, 2)
        optimizer = paddle.optimizer.AdamW(parameters=layer.parameters(), learning_rate=0.1)
        if wrap:
            layer, optimizer = pcp.parallelize(layer, optimizer, mesh=dist.ProcessMesh([0], dim_names=["dp"]),
                                               config={"dp_config": {"sharding_level": 0}})
            assert isinstance(optimizer, ParallelOptimizer)
        loss = (layer(paddle.ones([2, 3])) ** 2).sum()
        loss.backward()
        optimizer.minimize(loss)
        return layer.weight.numpy(), optimizer

    want, _ = trained(wrap=False)
    got, optimizer = trained(wrap=True)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="give the parameters to the optimizer"):
        optimizer.minimize(None, parameters=[])
