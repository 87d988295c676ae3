"""Gradient buckets in one process: how parameters are cut into buckets (data_parallel/buckets.py) and
dp_config's bucket_size_mb; the multi-rank behaviour is tests/multiproc/test_grad_buckets.py."""
import paddle
import paddle.distributed as dist
import pytest

import paddle_cp as pcp
from paddle_cp.data_parallel.buckets import DEFAULT_BUCKET_MB, MB, bucket_size_mb, plan_buckets
from paddle_cp.data_parallel.sharding import check_level
from paddle_cp.params import Partial, mark_fetch_unit, record_of
from paddle_cp.mesh import mesh_group


def _model():
    model = paddle.nn.Sequential(paddle.nn.Linear(256, 256), paddle.nn.Linear(256, 256), paddle.nn.Linear(256, 8))
    model[1].bias.stop_gradient = True  # frozen: never reduced
    return model


def test_buckets_run_in_reverse_order_within_the_size(monkeypatch):
    """Every trained parameter placed over more than one rank, last first, in runs of at most the size (one
    larger parameter alone); a fetch unit's parameters in runs of their own, after the others, only reduced in
    step()."""
    model = _model()
    mesh = dist.ProcessMesh([0], dim_names=["dp"])
    group = mesh_group(mesh, ["dp"])
    monkeypatch.setattr(type(group), "size", property(lambda self: 2))  # as if over two ranks
    for p in model.parameters():
        record_of(p).place(Partial(group, "avg"))
    mark_fetch_unit(model[2])
    buckets, step_only = plan_buckets(model, list(model.parameters()), 0.3)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [[names[id(p)] for p in b] for b in buckets] == [["1.weight", "0.bias"], ["0.weight"], ["2.bias", "2.weight"]]
    assert step_only == {id(model[2].weight), id(model[2].bias)}
    assert all(sum(4 * p.numel().item() for p in b) <= 0.3 * MB for b in buckets)
    small, _ = plan_buckets(model, list(model.parameters()), 0.1)
    assert [[names[id(p)] for p in b] for b in small] == [["1.weight"], ["0.bias"], ["0.weight"],
                                                         ["2.bias", "2.weight"]]  # a 0.25 MiB weight alone


def test_parameters_on_one_rank_are_not_bucketed():
    model = _model()
    mesh = dist.ProcessMesh([0], dim_names=["dp"])
    for p in model.parameters():
        record_of(p).place(Partial(mesh_group(mesh, ["dp"]), "avg"))
    assert plan_buckets(model, list(model.parameters()), DEFAULT_BUCKET_MB) == ([], set())


@pytest.mark.parametrize("size", [0, -1, "25", True, float("inf")])
def test_bucket_size_is_checked_with_the_config(size):
    with pytest.raises(ValueError, match="bucket_size_mb must be a positive number"):
        check_level({"sharding_level": 2, "bucket_size_mb": size})


def test_bucket_size_default_and_given():
    assert bucket_size_mb(None) == DEFAULT_BUCKET_MB == 25 and bucket_size_mb({"bucket_size_mb": 0.5}) == 0.5
    assert check_level({"sharding_level": 1, "bucket_size_mb": 4}) == 1


def test_optimizer_on_one_rank_steps_as_before():
    """A single-rank mesh: nothing to bucket; step, clear_grad and minimize as Paddle's."""
    paddle.seed(3)
    layer = paddle.nn.Linear(3, 2)
    optimizer = paddle.optimizer.SGD(learning_rate=0.5, parameters=layer.parameters())
    layer, optimizer = pcp.parallelize(layer, optimizer, mesh=dist.ProcessMesh([0], dim_names=["dp"]),
                                       config={"dp_config": {"sharding_level": 0, "bucket_size_mb": 1}})
    assert optimizer.gradient_buckets.buckets == []
    before = layer.weight.numpy().copy()
    layer(paddle.ones([1, 3])).sum().backward()
    grad = layer.weight.grad.numpy().copy()
    optimizer.step()
    assert abs(layer.weight.numpy() - (before - 0.5 * grad)).max() < 1e-7
