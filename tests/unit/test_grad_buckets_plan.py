"""Gradient buckets in one process: how parameters are cut into buckets (data_parallel/buckets.py) and
dp_config's bucket_size_mb; the multi-rank behaviour is tests/multiproc/test_grad_buckets.py."""
import math

import numpy as np
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


class _HeldGradients:
    """Gradients kept here by parameter (OwnGradients' two questions)."""

    def __init__(self, grads):
        self.grads = grads

    def gradient(self, param):
        return self.grads.get(id(param))

    def release(self, param):
        self.grads.pop(id(param), None)


@pytest.mark.parametrize("sizes, owners, expected", [
    ([1000, 1200, 900, 1100], [0, 1, 2, 3], {"reduce_scatter": 1, "reduce": 0}),  # owners of about equal shares
    ([3000], [2], {"reduce_scatter": 0, "reduce": 1}),  # one owner: a layer's weight alone in its bucket
    ([3000, 40], [0, 2], {"reduce_scatter": 0, "reduce": 2}),  # padding would move 3 x 3000 for 3040
    ([500, 400, 300], [0, 1, 1], {"reduce_scatter": 0, "reduce": 2}),  # 3 x 700 for 1200
    ([1000, 600, 400, 1000], [0, 1, 1, 3], {"reduce_scatter": 1, "reduce": 0}),  # 3 x 1000 for 3000, one empty
])
def test_a_level_2_bucket_is_one_nccl_collective_per_owner_present_at_most(monkeypatch, sizes, owners, expected):
    """The collectives a level-2 bucket issues on the NCCL path (comm.collectives' native branch, the ops
    recorded instead of run; one process standing for position 0 of 4 ranks that all hold the same
    gradients): one reduce-scatter of the owners' chunks padded to the largest where that moves no more bytes
    per rank than reducing each onto its owner, else one reduce per owner present (none for the owners of
    nothing here). The owner gets the average."""
    from paddle_cp.comm import collectives, p2p
    from paddle_cp.data_parallel.buckets import GradientBuckets
    from paddle_cp.mesh import MeshGroup
    from paddle_cp.params import Owned

    n = 4
    group = MeshGroup(ranks=tuple(range(n)), index=0, group=None)
    params, grads = [], {}
    for i, (size, owner) in enumerate(zip(sizes, owners)):
        param = paddle.create_parameter([size], "float32")
        record_of(param).place(Owned(group, group, None, owner, 2))
        grads[id(param)] = paddle.full([size], float(i + 1))
        params.append(param)
    issued = {"reduce_scatter": [], "reduce": []}

    def reduce_scatter(out, flat, group=None, sync_op=True):  # every rank holds `flat`: the sum is n x slot 0
        issued["reduce_scatter"].append(math.prod(flat.shape))
        paddle.assign(flat.reshape([n, -1])[0] * n, output=out)

    def reduce(tensor, dst, group=None, sync_op=True):
        issued["reduce"].append(dst)
        if dst == 0:
            paddle.assign(tensor * n, output=tensor)

    monkeypatch.setattr(p2p, "uses_native_p2p", lambda tensor: True)
    monkeypatch.setattr(dist.stream, "reduce_scatter", reduce_scatter)
    monkeypatch.setattr(dist, "reduce", reduce)
    buckets = GradientBuckets([params], set(), _HeldGradients(dict(grads)))
    expected_grads = {id(p): grads[id(p)].numpy() for p, owner in zip(params, owners) if owner == 0}
    buckets._reduce(buckets.buckets[0])
    buckets._finish_in_flight()

    assert {op: len(calls) for op, calls in issued.items()} == expected, issued
    chunks = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(n)]
    assert collectives.pads_uneven_chunks(chunks) == bool(expected["reduce_scatter"])
    if expected["reduce_scatter"]:
        assert issued["reduce_scatter"] == [n * max(chunks)]  # padding: n x largest - the gradients
    else:
        assert sorted(issued["reduce"]) == sorted(r for r in range(n) if chunks[r])
    values = buckets.buckets[0].values
    assert set(values) == set(expected_grads)
    for key, want in expected_grads.items():
        np.testing.assert_array_equal(values[key].numpy(), want)


def test_llama_3_8b_level_2_buckets_over_8_ranks_on_nccl():
    """The collectives Llama-3-8B's level-2 buckets issue on NCCL over 8 ranks (default 25 MiB buckets, fp32
    gradients): cut by plan_buckets, owners by sharding's greedy balance, each bucket's path by
    collectives.pads_uneven_chunks. One reduce per owner present (a layer's weight is a bucket of its own);
    padding every bucket to one reduce-scatter would add 7x the gradient bytes (docs/tensor_parallel.md)."""
    from types import SimpleNamespace

    from paddle_cp.comm.collectives import pads_uneven_chunks
    from paddle_cp.data_parallel.sharding import owners
    from paddle_cp.mesh import MeshGroup
    from paddle_cp.params import Owned

    n, hidden, ffn, vocab, kv = 8, 4096, 14336, 128256, 1024
    layer = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, ffn), (hidden, ffn),
             (ffn, hidden), (hidden,), (hidden,)]  # q, k, v, o, gate, up, down, two norms
    shapes = [(vocab, hidden)] + layer * 32 + [(hidden,), (hidden, vocab)]
    group = MeshGroup(ranks=tuple(range(n)), index=0, group=None)
    params = [SimpleNamespace(shape=list(s), stop_gradient=False, dtype=paddle.float32, element_size=lambda: 4)
              for s in shapes]
    for param, owner in zip(params, owners(params, n)):
        record_of(param).place(Owned(group, group, None, owner, 2))
    model = SimpleNamespace(sublayers=lambda include_self=False: [])
    buckets, _ = plan_buckets(model, params, DEFAULT_BUCKET_MB)

    calls, padded_bytes, gradient_bytes = {"reduce_scatter": 0, "reduce": 0}, 0, 0
    for bucket in buckets:
        chunks = [sum(math.prod(p.shape) for p in bucket if record_of(p).placements[0].owner == r) for r in range(n)]
        gradient_bytes += 4 * sum(chunks)
        padded_bytes += 4 * (n * max(chunks) - sum(chunks))
        if pads_uneven_chunks(chunks):
            calls["reduce_scatter"] += 1
        else:
            calls["reduce"] += sum(1 for c in chunks if c)
    assert len(buckets) == 258 and calls == {"reduce_scatter": 0, "reduce": 291}  # before: 8 reduces each, 2064
    assert round(gradient_bytes / 2 ** 30, 1) == 29.9 and round(padded_bytes / 2 ** 30) == 209
