"""ConvParallel on one process: Paddle's conditions refused before any collective, and the halo each
layout needs (checked by rebuilding one card's output from zero-padded parts widened by that halo)."""
import numpy as np
import paddle
import paddle.distributed as dist
import pytest

import paddle_cp as pcp
from paddle_cp.plans.conv_parallel import check_input_width, width_geometry


def _parallelize(conv, key="0", dims=("mp",)):
    mesh = dist.ProcessMesh(np.arange(2).reshape([1] * (len(dims) - 1) + [2]).tolist(), dim_names=list(dims))
    return pcp.parallelize(paddle.nn.Sequential(conv), mesh=mesh,
                           config={"mp_config": {"parallelize_plan": {key: pcp.ConvParallel()}}})


BAD_LAYERS = {
    "dilation_on_w": (paddle.nn.Conv2D(2, 2, 3, padding=2, dilation=2), "dilation along W must be 1"),
    "no_padding_overlapping_windows": (paddle.nn.Conv2D(2, 2, 3), "stride must equal the kernel width"),
    "padding_with_stride_2": (paddle.nn.Conv2D(2, 2, 3, stride=2, padding=1), "stride 1 and padding 1"),
    "padding_not_same": (paddle.nn.Conv2D(2, 2, 3, padding=2), "left \\+ right = kernel width - 1"),
    "same_with_stride_2": (paddle.nn.Conv2D(2, 2, 3, stride=2, padding="SAME"), "stride must equal"),
    "reflect_padding": (paddle.nn.Conv2D(2, 2, 3, padding=1, padding_mode="reflect"), "padding_mode='zeros'"),
    "not_a_conv2d": (paddle.nn.Linear(4, 4), "applies to a paddle.nn.Conv2D"),
    "conv1d": (paddle.nn.Conv1D(2, 2, 3, padding=1), "applies to a paddle.nn.Conv2D"),
}


@pytest.mark.parametrize("name", BAD_LAYERS)
def test_unsupported_layer_is_refused_before_any_collective(name):
    layer, message = BAD_LAYERS[name]
    with pytest.raises(ValueError, match=message):
        _parallelize(layer)


def test_plan_on_a_parameter_or_without_mp_is_refused():
    with pytest.raises(ValueError, match="key it by the layer's name"):
        _parallelize(paddle.nn.Conv2D(2, 2, 3, padding=1), key="0.weight")
    with pytest.raises(ValueError, match="mp"):
        _parallelize(paddle.nn.Conv2D(2, 2, 3, padding=1), dims=("dp",))


HALOS = [  # (layer, data_format's W axis, (left, right) halo)
    (dict(kernel_size=3, padding=1), (1, 1)),
    (dict(kernel_size=[1, 5], padding=[0, 2]), (2, 2)),
    (dict(kernel_size=[3, 4], padding=[1, 1, 1, 2]), (1, 2)),  # [top, bottom, left, right]
    (dict(kernel_size=4, padding="SAME"), (1, 2)),  # Paddle's op pads the smaller half first
    (dict(kernel_size=2, stride=2), (0, 0)),
    (dict(kernel_size=[3, 2], stride=[1, 2], padding=[1, 0], groups=2), (0, 0)),
    (dict(kernel_size=2, stride=2, padding="VALID"), (0, 0)),
    (dict(kernel_size=1), (0, 0)),
]


@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
@pytest.mark.parametrize("kwargs,halo", HALOS, ids=lambda v: str(v))
def test_halo_rebuilds_one_card_output(kwargs, halo, data_format):
    """Each of 4 'ranks' convolves its 4 columns widened by `halo` (zeros past the ends) and drops
    the columns the halo produced: together they give one card's output."""
    paddle.seed(0)
    conv = paddle.nn.Conv2D(4, 6, data_format=data_format, **kwargs)
    geometry = width_geometry(conv)
    assert geometry.halo == halo
    assert geometry.axis == {"NCHW": 3, "NHWC": 2}[data_format]
    width, mp = 16, 4
    check_input_width(geometry, width, mp)
    shape = [2, 4, 5, width] if data_format == "NCHW" else [2, 5, width, 4]
    x = paddle.randn(shape)
    axis, (left, right), part = geometry.axis, halo, width // mp
    padded = np.pad(x.numpy(), [(left, right) if a == axis else (0, 0) for a in range(4)])
    outputs = []
    for rank in range(mp):
        widened = paddle.to_tensor(np.take(padded, range(rank * part, rank * part + left + part + right), axis=axis))
        out = conv(widened)
        outputs.append(paddle.slice(out, [axis], [left], [out.shape[axis] - right]).numpy())
    np.testing.assert_allclose(np.concatenate(outputs, axis=axis), conv(x).numpy(), atol=1e-5)


INPUT_WIDTHS = [  # (layer, width, mp, what the error names)
    (dict(kernel_size=3, padding=1), 10, 4, "not divisible by mp=4"),
    (dict(kernel_size=2, stride=2), 12, 4, "multiple of 8"),
    (dict(kernel_size=7, padding=3), 4, 2, "fewer than the 3 halo columns"),
]


@pytest.mark.parametrize("kwargs,width,mp,message", INPUT_WIDTHS)
def test_input_width_conditions(kwargs, width, mp, message):
    with pytest.raises(ValueError, match=message):
        check_input_width(width_geometry(paddle.nn.Conv2D(2, 2, **kwargs)), width, mp)
