"""The float64 truth of an fp32 model: the same model, weights and inputs evaluated in float64.

Some models amplify fp32 rounding (Qwen3-Next's tiny config: its own fp32 run differs from itself by ~5e-5 on
logits when its gated delta rule merely chunks otherwise), so "equal to one card at 1e-5" cannot hold for any
implementation. What can be checked is distance from the truth: an implementation is exact when it is as close
to the float64 evaluation as one card is (check_parity's verdict, and the test suite's bound).

`float64_math()` makes every float32 the model code asks for a float64 while it runs (casts, `.float()`,
`.to(float32)`, softmax's dtype, the default dtype), so code that computes in fp32 on purpose (RMSNorms, the
rule's `.to(paddle.float32)`, the MoE router's softmax) runs in float64 too, and it checks with Paddle's own
per-dtype operator counter that no operator computed in float32 meanwhile (a cast this patch missed would leave an
fp32 rounding in the truth); `float64_model(model)` casts the parameters the fp32 model was initialised with, so
the truth starts from the same values, and `float64_weights(model)` does so only while it runs.
"""
import contextlib

import numpy as np
import paddle
import paddle.nn.functional as F

from .operator_calls import operator_calls

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
    try:
        with operator_calls() as calls:
            yield
        in_float32 = {op for op, counts in calls.items() if "float32" in counts} - EXACT_IN_FLOAT32
        if in_float32:
            raise TypeError(f"operators computed in float32 inside the float64 truth: {sorted(in_float32)} (a cast "
                            "to fp32 float64_math does not widen)")
    finally:
        for name, method in saved.items():
            setattr(tensor, name, method)
        paddle.cast, F.softmax = saved_cast, saved_softmax
        paddle.set_default_dtype(saved_default)


def float64_model(model):
    """`model` (built in fp32) with its floating parameters and buffers cast to float64 in place (outside
    `float64_math`: the casts themselves are float32 operators); integer buffers keep their dtype."""
    for tensor in _floating_tensors(model):
        _cast_in_place(tensor, paddle.float64)
    return model


def float64_weights(model):
    return weights_as(model, paddle.float64)


@contextlib.contextmanager
def weights_as(model, dtype):
    """`model`'s floating parameters and buffers as `dtype` (wider than theirs) while it runs, then each back to
    its own dtype: a round trip fp32 -> float64 -> fp32 (bf16 -> fp32 -> bf16) is exact, and the tensors stay
    the same objects (optimizers, hooks and plans holding them see the same values after)."""
    tensors = _floating_tensors(model)
    dtypes = [t.dtype for t in tensors]
    for tensor in tensors:
        _cast_in_place(tensor, dtype)
    try:
        yield model
    finally:
        for tensor, dtype in zip(tensors, dtypes):
            _cast_in_place(tensor, dtype)


def _floating_tensors(model):
    seen, tensors = set(), []
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen and tensor._is_initialized() and paddle.is_floating_point(tensor):
            seen.add(id(tensor))
            tensors.append(tensor)
    return tensors


def _cast_in_place(tensor, dtype):
    """`tensor` holding its values in `dtype`, as the same Tensor object (what Layer.to does to each tensor)."""
    if tensor.dtype != dtype:
        with paddle.no_grad():
            cast = tensor.cast(dtype)  # held until shared: its buffer must outlive the call
            tensor.value().get_tensor()._share_data_with(cast.value().get_tensor())


def widened_inputs(inputs, dtype):
    """{name: tensor} with floating tensors narrower than `dtype` (masks, embeddings) as `dtype`."""
    return {k: v.astype(dtype) if isinstance(v, paddle.Tensor) and paddle.is_floating_point(v)
            and paddle.finfo(v.dtype).bits < paddle.finfo(dtype).bits else v for k, v in inputs.items()}
