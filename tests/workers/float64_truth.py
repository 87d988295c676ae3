"""The float64 truth of an fp32 model: the same model, inputs and optimizer evaluated in float64.

Some models amplify fp32 rounding (Qwen3-Next's tiny config: its own fp32 run differs from itself by ~5e-5 on
logits when its gated delta rule merely chunks otherwise), so "equal to one card at 1e-5" cannot hold for any
implementation. What can be checked is distance from the truth: an implementation is exact when it is as close
to the float64 evaluation as one card is.

`float64_math()` makes every float32 the model code asks for a float64 while it runs (casts, `.float()`,
`.to(float32)`, softmax's dtype, the default dtype), so code that computes in fp32 on purpose (RMSNorms, the
rule's `.to(paddle.float32)`, the MoE router's softmax) runs in float64 too, and it checks with Paddle's own
per-dtype operator counter that no operator computed in float32 meanwhile (a cast this patch missed would leave an
fp32 rounding in the truth); `float64_model(model)` casts the parameters the fp32 model was initialised with, so
the truth starts from the same values.
"""
import contextlib
import functools

import numpy as np
import paddle
import paddle.nn.functional as F

_FLOAT32 = (paddle.float32, "float32", np.float32, np.dtype("float32"))
# Operators allowed to run in float32 inside the truth: those on the MoE block's one-hot expert mask
# (`F.one_hot` is float32 whatever the default dtype; its 0/1 values, their sums and indices are exact).
EXACT_IN_FLOAT32 = {"fill_constant", "less_equal", "where_index", "slice", "reduce_sum", "reshape", "transpose2"}


def _widen(value):
    """float32 (in any spelling) -> float64; anything else unchanged."""
    if isinstance(value, paddle.Tensor):  # `.to(other_tensor)`: that tensor's dtype
        return value
    return paddle.float64 if any(value is f or value == f for f in _FLOAT32) else value


@contextlib.contextmanager
def float64_math():
    """While it runs, float32 means float64: in casts, `.float()`, `.to()`, softmax's dtype and new tensors."""
    tensor = paddle.Tensor
    saved = {name: getattr(tensor, name) for name in ("to", "astype", "cast", "float")}
    saved_cast, saved_softmax, saved_default = paddle.cast, F.softmax, paddle.get_default_dtype()

    def widened(method):
        def call(self, *args, **kwargs):
            return method(self, *(_widen(a) for a in args), **{k: _widen(v) for k, v in kwargs.items()})
        return call

    tensor.to, tensor.astype, tensor.cast = (widened(saved[name]) for name in ("to", "astype", "cast"))
    tensor.float = lambda self: saved["astype"](self, paddle.float64)
    paddle.cast = lambda x, dtype: saved_cast(x, _widen(dtype))
    F.softmax = lambda x, *args, dtype=None, **kwargs: saved_softmax(x, *args, dtype=_widen(dtype), **kwargs)
    paddle.set_default_dtype("float64")
    paddle.base.core.clear_low_precision_op_list()
    paddle.set_flags({"FLAGS_low_precision_op_list": 1})  # counts each operator's calls per dtype
    try:
        yield
        calls = paddle.base.core.get_low_precision_op_list()  # {op: "fp16,bf16,fp32,other"}
        in_float32 = {op for op, counts in calls.items() if counts.split(",")[2] != "0"} - EXACT_IN_FLOAT32
        if in_float32:
            raise TypeError(f"operators computed in float32 inside the float64 truth: {sorted(in_float32)} (a cast "
                            "to fp32 float64_math does not widen)")
    finally:
        paddle.set_flags({"FLAGS_low_precision_op_list": 0})
        for name, method in saved.items():
            setattr(tensor, name, method)
        paddle.cast, F.softmax = saved_cast, saved_softmax
        paddle.set_default_dtype(saved_default)


def float64_model(model):
    """`model` (built in fp32) with its parameters and buffers cast to float64 (outside `float64_math`: the casts
    themselves are float32 operators)."""
    return model.to(dtype="float64")


def float64_inputs(inputs):
    """{name: tensor} with float32 tensors (masks) as float64."""
    return {k: v.astype("float64") if isinstance(v, paddle.Tensor) and v.dtype == paddle.float32 else v
            for k, v in inputs.items()}


def rechunked(model, chunk_size=8):
    """`model` with every Gated DeltaNet rule chunked by `chunk_size` instead of its 64: the same arithmetic in
    another order, a second fp32 evaluation as valid as the default one (each is one sample of the model's
    rounding noise; one card's distance from the truth is the larger of the two)."""
    for layer in model.sublayers():
        if callable(getattr(layer, "chunk_gated_delta_rule", None)):
            layer.chunk_gated_delta_rule = functools.partial(layer.chunk_gated_delta_rule, chunk_size=chunk_size)
    return model
