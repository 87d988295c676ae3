"""Hooks that change a layer put it back even when the layer's forward raises."""
import paddle
import paddle.distributed as dist
import pytest

import paddle_cp as pcp


def test_rowwise_keeps_its_bias_when_the_forward_raises():
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 3))
    bias = model[0].bias
    mesh = dist.ProcessMesh([0], dim_names=["mp"])
    pcp.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": {"0": pcp.RowWiseParallel()}}})
    with pytest.raises(Exception):
        model(paddle.ones([2, 5]))  # wrong width: the matmul raises between the plan's pre- and post-hook
    assert model[0].bias is bias
    out = model(paddle.ones([2, 4]))
    expected = paddle.ones([2, 4]) @ model[0].weight + bias
    assert float((out - expected).abs().max()) < 1e-6
