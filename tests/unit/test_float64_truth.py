"""paddle_cp/api/float64_truth.py: check_parity's float64 pass widens a model in place and restores it exactly."""
import numpy as np
import paddle
import pytest

from paddle_cp.api.float64_truth import float64_math, float64_weights, widened_inputs


class Scaled(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.linear = paddle.nn.Linear(4, 4)
        self.register_buffer("steps", paddle.to_tensor([3], dtype="int64"))
        self.register_buffer("scale", paddle.to_tensor([0.1], dtype="float32"))

    def forward(self, x):
        return paddle.nn.functional.softmax(self.linear(x) * self.scale, axis=-1)


def test_weights_are_float64_inside_and_the_same_tensors_bit_for_bit_after():
    paddle.seed(0)
    model, x = Scaled(), paddle.randn([2, 4])
    weight, before = model.linear.weight, model.linear.weight.numpy().copy()
    wide = x.astype("float64")  # outside float64_math, whose operator check would count this cast as fp32
    with float64_weights(model), float64_math():
        out = model(wide)
        assert out.dtype == paddle.float64 and model.linear.weight.dtype == paddle.float64
        assert model.scale.dtype == paddle.float64 and model.steps.dtype == paddle.int64  # integers untouched
    assert model.linear.weight is weight and weight.dtype == paddle.float32 and model.scale.dtype == paddle.float32
    assert np.array_equal(weight.numpy(), before) and model.scale.numpy()[0] == np.float32(0.1)
    np.testing.assert_allclose(out.numpy(), model(x).numpy(), atol=1e-6)


def test_a_float32_operator_inside_the_truth_is_refused():
    with pytest.raises(TypeError, match="operators computed in float32 inside the float64 truth"):
        with float64_math():
            paddle.to_tensor(np.ones(3, np.float32)) * 2  # a tensor made from fp32 data, not through a widened cast


def test_inputs_are_widened_to_the_pass_dtype_and_only_the_narrower_floats():
    """float64 pass: fp32 masks become float64; fp32 pass of a low-precision model: bf16/fp16 ones become fp32;
    integer inputs (ids, row indices) and non-tensors stay as they are."""
    inputs = {"ids": paddle.to_tensor([[1, 2]]), "mask": paddle.ones([1, 2]), "bf16": paddle.ones([2], "bfloat16"),
              "fp16": paddle.ones([2], "float16"), "wide": paddle.ones([2], "float64"), "flag": True}
    dtypes = {k: getattr(v, "dtype", v) for k, v in widened_inputs(inputs, paddle.float64).items()}
    assert dtypes == {"ids": paddle.int64, "mask": paddle.float64, "bf16": paddle.float64, "fp16": paddle.float64,
                      "wide": paddle.float64, "flag": True}
    dtypes = {k: getattr(v, "dtype", v) for k, v in widened_inputs(inputs, paddle.float32).items()}
    assert dtypes == {"ids": paddle.int64, "mask": paddle.float32, "bf16": paddle.float32, "fp16": paddle.float32,
                      "wide": paddle.float64, "flag": True}
