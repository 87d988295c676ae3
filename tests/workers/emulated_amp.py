"""Paddle's GPU mixed precision (`paddle.amp.decorate` O1/O2, `auto_cast`, master gradients, multi-precision
AdamW), emulated on CPU for tests, so that real float16/bfloat16 tensors go through paddle_cp.

Entry points (stable; other tests and workers import them):
- `install(set_attr=setattr)`: patches `paddle.amp.decorate` / `amp_decorate`, `paddle.amp.auto_cast` /
  `amp_guard`, the `_C_ops` ops listed in COMPUTE_OPS, MEMORY_OPS, CREATION_OPS and IN_PLACE_OPS, the Tensor arithmetic operators,
  `_C_ops.adamw_` / `_C_ops.adam_`, `Tensor._register_backward_hook` (master gradients settle first) and
  `paddle.framework._dygraph_tracer` / `paddle.base.framework._dygraph_tracer` (the autocast state as Python
  reads it); idempotent. `set_attr`: pytest's monkeypatch.setattr to undo it.
- `decorate(...)`, `auto_cast(...)`: what install puts in place of Paddle's (same signatures).
- `reset()`: forgets Paddle's global AMP state (`use_master_grad`, the decorated parameters), so one
  process can run several decorated models one after the other.
- `ROUNDING`: the relative size of one ulp of each low dtype (2^-8 bf16, 2^-11 fp16).

Written from Paddle 3.3.1's python sources (paddle/amp/auto_cast.py, amp_lists.py, optimizer/adamw.py)
and what this CPU wheel does (measured); every fact carries its source:

- Why it is needed: `amp_decorate` returns the objects untouched unless the expected place is a GPU, XPU
  or custom device (auto_cast.py:952 "check device_type"), and `amp_guard` warns and disables itself on
  CPU (auto_cast.py:588). CPU Paddle registers no float16/bfloat16 kernel for add, exp, mean, softmax,
  matmul, adamw (measured: NotFound); memory ops (cast, concat, split, slice, reshape, transpose, assign)
  and multiply/subtract/scale/sum/add_n have them.
- decorate: level "O1" returns the objects unchanged (auto_cast.py:940). "O2" calls Paddle's own
  `amp_initialize(models, dtype, excluded_layers)` (reused here): every sublayer's floating parameters and
  buffers cast in place (`Layer._to_impl(floating_only=True)`) except layers with `_cast_to_low_precision`
  False (`excluded_layers`), the BatchNorm family, and, for float16 only, LayerNorm/InstanceNorm
  (`need_keep_fp32`). Then `_set_multi_precision(opt, master_weight is not False)` on each optimizer
  (sets `_multi_precision` where the attribute exists), and with `master_grad=True`
  `amp_global_state().use_master_grad = True` and the models' parameters appended to
  `amp_global_state().model_parameters` (auto_cast.py:1029). `save_dtype` is refused here.
- auto_cast (dygraph `amp_guard`): the tracer's `_amp_level`, `_amp_dtype` and op lists read from Python
  (`paddle.framework._dygraph_tracer()`, what Paddle's recompute reads to replay a forward under the same
  autocast) are amp_guard's; per op the destination dtype of `GetAmpDestDtype` with `use_promote`
  (the default): an op on the white list computes in the AMP dtype; on the black list in float32; any other
  in float32 when an input is float32, else in the AMP dtype. Lists: amp_lists.py, `white_list()[dtype][level]`
  and `black_list()[dtype][level]` plus the custom ones (`_update_list`): O1 blacks out FP16_BLACK_LIST |
  EXTRA_BLACK_LIST (softmax, mean, exp, layer_norm, pow, rsqrt, reduce_sum, cross entropies ...), O2 only
  EXTRA_BLACK_LIST. Ops are matched by their eager name (the `_C_ops` function); `linear` is matched as
  `matmul` (dygraph `_C_ops.linear` is matmul + add; matmul is on WHITE_LIST). Inputs of dtype
  float32/float16/bfloat16 are cast to the destination (AmpAutoCast), others left alone.
- Master gradients: on entering auto_cast with `use_master_grad` set and no hook pending, Paddle registers
  a final backward hook calling `core.eager.set_master_grads(model_parameters)` (auto_cast.py:677-743),
  which casts each float16/bfloat16 `.grad` to float32 at the end of backward; reused as is (it works on
  CPU, measured). The next backward's low-precision gradient then meets an fp32 `.grad`: this CPU build's
  GradNodeAccumulation raises there (measured: "type of data we are trying to retrieve (bfloat16) does not
  match ... (float32)"). On GPU Paddle accumulates it (its test/amp/test_amp_master_grad.py,
  test_adam_master_grad: two backwards per step under master_grad, float32 gradients, Adam stepping).
  The emulation accumulates it in float32, as Paddle's main-grad hook does
  (`_update_main_grad_hook`: `main_grad.add_(cast(tmp_grad, float32))`): a gradient hook takes the fp32
  `.grad` away before Paddle accumulates, and before any hook that runs after accumulation
  (`_register_backward_hook`, what paddle_cp's buckets use) the parameter's `.grad` becomes
  fp32 held + fp32(new). So every reader sees the fp32 sum, as on a GPU that accumulates in fp32.
- Kernels: an op whose floating inputs hold float16/bfloat16 (after autocast) computes in float32 on those
  values and rounds its floating outputs to that dtype once: what a GPU half-precision kernel does with
  its float32 accumulator (`MPTypeTrait<bfloat16>::Type` is float; cuBLAS computes bf16 GEMMs in fp32).
  Backward follows through autograd: the output's cast passes the incoming gradient up to float32, the
  float32 op's gradient runs, and the input's cast rounds the gradient to the input's dtype, once per
  backward kernel as the GPU's grad kernels do. A float32 input among low ones (no autocast cast it)
  makes the result float32 (Paddle's type promotion for mixed operands). Differences from a GPU kernel:
  a kernel that rounds inside (flash attention, fused norms) rounds here only at its outputs; two
  gradients of one tensor are summed in float32 from their rounded values (Paddle sums them in the dtype).
- View ops (slice, strided_slice, transpose, reshape, squeeze, unsqueeze, flatten, unbind) stay Paddle's own:
  their stride kernels run on CPU float16/bfloat16 forward and backward and share the input's memory
  (measured), and Paddle's code writes through them: its flex-checkpoint loader (flex_checkpoint/dcp/utils.py
  `assign_sharded_slice`) assigns each checkpoint slice into `paddle.slice(parameter, ...)`, so a copy there
  would load nothing into a bfloat16 model.
- AdamW/Adam on float16/bfloat16 parameters: CPU has no such kernel (measured NotFound). The GPU
  multi-precision kernel (`multi_precision=True`, master weight given: adamw.py:538) computes in float32
  (MT) on the master weight with the gradient cast to float32 and writes the parameter as the master
  rounded to its dtype: emulated by Paddle's own float32 kernel on the master weight, then the parameter
  assigned the rounded master. Without a master weight the parameter, moments and gradient are taken to
  float32 for the update and rounded back.
- Op names: the lists hold some ops by their legacy names (`softmax_with_cross_entropy`, `reduce_sum`,
  `lookup_table_v2`), which no eager op carries: here `cross_entropy_with_softmax`, `sum` and `embedding`
  are off the lists (at O1 they follow promotion). How Paddle's C++ tracer names them is GPU-side knowledge.
- Not emulated: autocast of ops outside COMPUTE_OPS (memory ops keep their dtype, as autocast leaves
  them), `use_promote=False`, `save_dtype`, `FLAGS_enable_tensor_fusion` (main_grad) mode, fp16 overflow
  beyond what the rounded values show, cuBLAS/cuDNN algorithm choices and speed.
"""
from __future__ import annotations

import contextlib
import sys

import paddle
from paddle import _C_ops
from paddle.base import core

FP32 = paddle.float32
LOW = (paddle.float16, paddle.bfloat16)
FLOATING = (FP32,) + LOW
ROUNDING = {paddle.bfloat16: 2.0 ** -8, paddle.float16: 2.0 ** -11}  # one ulp relative: the spacing at 1
_AMP = sys.modules["paddle.amp.auto_cast"]  # the module (paddle.amp.auto_cast the name is the function)

# The `_C_ops` compute ops models and paddle_cp call.
COMPUTE_OPS = (
    "matmul", "linear", "bmm", "einsum", "embedding", "softmax", "log_softmax", "cross_entropy_with_softmax",
    "silu", "gelu", "swiglu", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "pow", "square",
    "mean", "sum", "max", "logsumexp", "add", "subtract", "multiply", "divide", "scale", "maximum", "minimum",
    "clip", "abs", "cos", "sin", "layer_norm", "rms_norm", "squared_l2_norm", "cumsum", "where",
    "conv2d", "conv3d",  # vision towers' patch embeddings
)
# Memory ops whose backward kernels CPU lacks for half dtypes (concat_grad, measured): exact in float32 and
# back, so wrapped the same way; autocast treats them as any op off the lists. Not the view ops (docstring).
MEMORY_OPS = (
    "concat", "split", "split_with_num", "expand", "expand_as", "tile", "stack", "gather", "gather_nd",
    "index_select", "pad", "roll", "repeat_interleave", "take_along_axis", "put_along_axis", "tril", "triu",
    "flip", "index_put", "masked_select", "scatter",
)
# Ops making a tensor of a dtype argument (no CPU half kernel): made in float32, rounded once. Their dtype's index.
CREATION_OPS = {"arange": 3}  # a rotary table of a buffer O2 cast (Qwen-VL's inv_freq): arange(n, dtype=bf16)
# In-place ops (no CPU half kernel) emulated by their out-of-place twin, the first input then assigned.
IN_PLACE_OPS = ("scatter_", "add_", "subtract_", "multiply_", "scale_")
# Tensor operators (C methods that reach the kernels without `_C_ops`) and the op each is matched as.
OPERATORS = {
    "__add__": "add", "__radd__": "add", "__sub__": "subtract", "__rsub__": "subtract", "__mul__": "multiply",
    "__rmul__": "multiply", "__truediv__": "divide", "__rtruediv__": "divide", "__matmul__": "matmul",
    "__pow__": "pow", "__neg__": "scale",
}
AUTOCAST_NAMES = {"linear": "matmul"}
AMP_DTYPES = {"bfloat16": paddle.bfloat16, "float16": paddle.float16}


class _Autocast:
    """The innermost emulated auto_cast: (amp dtype, white list, black list, level), or None outside."""
    current = None


def _floating(values):
    for value in values:
        if isinstance(value, paddle.Tensor) and value.dtype in FLOATING:
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _floating(value)


def _cast(value, to):
    """`value` (a tensor, or lists of them) with its float32/float16/bfloat16 tensors cast by `to(tensor)`."""
    if isinstance(value, paddle.Tensor):
        return to(value) if value.dtype in FLOATING else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, to) for v in value)
    return value


def _destination(name, tensors):
    """The dtype autocast runs op `name` in (GetAmpDestDtype with use_promote), or None outside auto_cast."""
    state = _Autocast.current
    if state is None or not tensors:
        return None
    dtype, white, black, _ = state
    name = AUTOCAST_NAMES.get(name, name)
    if name in white:
        return dtype
    if name in black or any(t.dtype == FP32 for t in tensors):
        return FP32
    return dtype


def _run(name, fn, args, kwargs):
    tensors = list(_floating(list(args) + list(kwargs.values())))
    dest = _destination(name, tensors)
    if dest is not None and any(t.dtype != dest for t in tensors):
        args, kwargs = _cast(args, lambda t: t.astype(dest) if t.dtype != dest else t), \
            {k: _cast(v, lambda t: t.astype(dest) if t.dtype != dest else t) for k, v in kwargs.items()}
        tensors = list(_floating(list(args) + list(kwargs.values())))
    low = {t.dtype for t in tensors if t.dtype in LOW}
    if not low:
        return fn(*args, **kwargs)
    if len(low) > 1:
        raise TypeError(f"{name}: float16 and bfloat16 inputs together: {[t.dtype for t in tensors]}")
    (dtype,) = low
    mixed = any(t.dtype == FP32 for t in tensors)  # promoted: the result stays float32
    up = lambda t: t.astype(FP32) if t.dtype in LOW else t  # noqa: E731
    out = fn(*_cast(args, up), **{k: _cast(v, up) for k, v in kwargs.items()})
    return out if mixed else _cast(out, lambda t: t.astype(dtype) if t.dtype == FP32 else t)


def _emulated(name, fn):
    def op(*args, **kwargs):
        return _run(name, fn, args, kwargs)
    op.__wrapped__ = fn
    return op


def _emulated_creation(name, index):
    made = getattr(_C_ops, name)

    def op(*args, **kwargs):
        args = list(args)
        dtype = args[index] if len(args) > index else kwargs.get("dtype")
        if dtype not in LOW:
            return made(*args, **kwargs)
        if len(args) > index:
            args[index] = FP32
        else:
            kwargs["dtype"] = FP32
        up = lambda t: t.astype(FP32) if t.dtype in LOW else t  # noqa: E731
        return made(*_cast(args, up), **kwargs).astype(dtype)
    op.__wrapped__ = made
    return op


def _emulated_in_place(name):
    out_of_place, in_place = getattr(_C_ops, name[:-1]), getattr(_C_ops, name)

    def op(x, *args, **kwargs):
        if x.dtype not in LOW:
            return in_place(x, *args, **kwargs)
        if not x.stop_gradient:
            raise NotImplementedError(f"the AMP emulation's {name} covers tensors without gradient")
        with paddle.no_grad():
            paddle.assign(out_of_place(x, *args, **kwargs), output=x)  # out_of_place: an emulated op
        return x
    op.__wrapped__ = in_place
    return op


def _adam_on_master(kernel):
    """`_C_ops.adamw_` / `adam_` for float16/bfloat16 parameters: Paddle's float32 kernel on the master weight
    (or on float32 copies), the parameter assigned the result rounded to its dtype."""
    def step(param, grad, lr, moment1, moment2, moment2_max, beta1_pow, beta2_pow, master, found_inf, *attrs):
        if param.dtype not in LOW:
            return kernel(param, grad, lr, moment1, moment2, moment2_max, beta1_pow, beta2_pow, master, found_inf,
                          *attrs)
        attrs = list(attrs)
        multi_precision_at = len(attrs) - 3  # (..., multi_precision, use_global_beta_pow, amsgrad)
        attrs[multi_precision_at] = False
        moments = [m for m in (moment1, moment2, moment2_max) if m is not None]
        low_moments = [m for m in moments if m.dtype in LOW]
        weight = master if master is not None else param.astype(FP32)
        fp32 = {id(m): m.astype(FP32) for m in low_moments}
        m1, m2 = fp32.get(id(moment1), moment1), fp32.get(id(moment2), moment2)
        m2max = fp32.get(id(moment2_max), moment2_max) if moment2_max is not None else None
        kernel(weight, grad.astype(FP32), lr, m1, m2, m2max, beta1_pow, beta2_pow, None, found_inf, *attrs)
        with paddle.no_grad():
            paddle.assign(weight.astype(param.dtype), output=param)
            for moment in low_moments:
                paddle.assign(fp32[id(moment)].astype(moment.dtype), output=moment)
        return param, moment1, moment2, moment2_max, beta1_pow, beta2_pow, master
    step.__wrapped__ = kernel
    return step


# master gradients ------------------------------------------------------------------------------

class _MasterGradients:
    """fp32 accumulation of a decorated low-precision parameter's gradients over backwards."""
    held = {}  # id(param) -> its fp32 gradient taken away before Paddle accumulated the next one
    FOLLOWED = "_emulated_master_gradient"  # set on a parameter given the hooks (ids are reused after GC)

    @classmethod
    def follow(cls, param):
        if getattr(param, cls.FOLLOWED, False) or param.dtype not in LOW or param.stop_gradient:
            return
        setattr(param, cls.FOLLOWED, True)

        def take_fp32(grad, param=param):
            current = param.grad
            if current is not None and current._is_initialized() and current.dtype == FP32:
                cls.held[id(param)] = current.clone()
                param.clear_gradient(False)
            return grad

        param.register_hook(take_fp32)
        _settling(param)  # a parameter no other post-accumulation hook reaches settles here

    @classmethod
    def settle(cls, param):
        held = cls.held.pop(id(param), None)
        if held is not None:
            total = held + param.grad.astype(FP32)
            param.clear_gradient(False)  # `.grad =` copies into the low-precision gradient otherwise
            param._set_grad_ivar(total)


def _settling(param, hook=None):
    """A post-accumulation hook on `param` that first settles its master gradient."""
    def run():
        _MasterGradients.settle(param)
        if hook is not None:
            return hook()
    return _ORIGINAL["_register_backward_hook"](param, run)


_ORIGINAL = {"_register_backward_hook": paddle.Tensor._register_backward_hook,
             "_dygraph_tracer": paddle.base.framework._dygraph_tracer}


def _register_backward_hook(self, hook):
    return _settling(self, hook)


def _register_master_grad_hook():
    """Paddle's: at auto_cast entry with master grads on, cast the decorated parameters' gradients to fp32 at
    the end of the next backward (auto_cast.py master_grad_hook, without the semi-auto mesh classification)."""
    state = _AMP.amp_global_state()
    if not state.use_master_grad or state.already_register_final_backward_hook:
        return

    def master_grad_hook():
        core.eager.set_master_grads(state.model_parameters)
        state.already_register_final_backward_hook = False

    core.eager._add_backward_final_hook(master_grad_hook)
    state.already_register_final_backward_hook = True


# decorate and auto_cast --------------------------------------------------------------------------

def decorate(models, optimizers=None, level="O1", dtype="float16", master_weight=None, save_dtype=None,
             master_grad=False, excluded_layers=None):
    """paddle.amp.decorate as on a GPU (amp_decorate past its device check)."""
    if level not in ("O1", "O2"):
        raise ValueError("level should be O1 or O2")  # amp_decorate's own check (auto_cast.py)
    if save_dtype is not None:
        raise NotImplementedError("the AMP emulation does not emulate save_dtype")
    if level == "O1":
        return models if optimizers is None else (models, optimizers)
    model_list = models if isinstance(models, list) else [models]
    _AMP.check_models(model_list)
    _AMP.amp_initialize(models=model_list, dtype=dtype, excluded_layers=excluded_layers)
    if optimizers is not None:
        for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
            _AMP._set_multi_precision(optimizer, master_weight is not False)
    if master_grad:
        state = _AMP.amp_global_state()
        state.use_master_grad = True
        for model in model_list:
            state.model_parameters.extend(model.parameters())
            for param in model.parameters():
                _MasterGradients.follow(param)
    return models if optimizers is None else (models, optimizers)


@contextlib.contextmanager
def auto_cast(enable=True, custom_white_list=None, custom_black_list=None, level="O1", dtype="float16",
              use_promote=True):
    """paddle.amp.auto_cast as on a GPU (dygraph amp_guard)."""
    level, dtype = level.upper(), str(dtype).replace("paddle.", "")
    if not enable or level == "O0":
        outer, _Autocast.current = _Autocast.current, None
    else:
        if not use_promote:
            raise NotImplementedError("the AMP emulation covers use_promote=True (Paddle's default)")
        white, black = _AMP._update_list(custom_white_list, custom_black_list, level, dtype)
        _register_master_grad_hook()
        outer, _Autocast.current = _Autocast.current, (AMP_DTYPES[dtype], white, black, level)
    try:
        yield
    finally:
        _Autocast.current = outer


class _TracerView:
    """The tracer as Python code reading the autocast state sees it: `_amp_level`, `_amp_dtype` and
    `_get_amp_op_list()` as amp_guard would have set them (Paddle's recompute, recompute.py:217, replays a
    forward under them; paddle_cp's SequenceTiled too); everything else, reads and writes, the real tracer's.
    The real tracer's own state is left alone: at level O2 it turns a CPU bfloat16 `clone` into float32
    (measured)."""

    def __init__(self, tracer):
        object.__setattr__(self, "_tracer", tracer)

    def __getattr__(self, name):
        state = _Autocast.current
        if name == "_amp_level":
            return core.AmpLevel.O0 if state is None else getattr(core.AmpLevel, state[3])
        if name == "_amp_dtype":
            return "float32" if state is None else str(state[0]).replace("paddle.", "")
        if name == "_get_amp_op_list":
            return (lambda: (set(), set())) if state is None else (lambda: (set(state[1]), set(state[2])))
        return getattr(self._tracer, name)

    def __setattr__(self, name, value):
        setattr(self._tracer, name, value)


def _tracer_view():
    tracer = _ORIGINAL["_dygraph_tracer"]()
    return _TracerView(tracer) if tracer is not None else None


def reset():
    """Forget Paddle's AMP global state (master grads, decorated parameters) and the held gradients."""
    state = _AMP.amp_global_state()
    state.use_master_grad = False
    state.model_parameters = []
    state.already_register_final_backward_hook = False
    _MasterGradients.held.clear()


def install(set_attr=setattr):
    """Patch Paddle so that mixed precision runs on CPU as described above. Idempotent."""
    if getattr(_C_ops.matmul, "__wrapped__", None) is not None:
        return
    for name in COMPUTE_OPS + MEMORY_OPS:
        set_attr(_C_ops, name, _emulated(name, getattr(_C_ops, name)))
    for name in IN_PLACE_OPS:
        set_attr(_C_ops, name, _emulated_in_place(name))
    for name, index in CREATION_OPS.items():
        set_attr(_C_ops, name, _emulated_creation(name, index))
    for dunder, name in OPERATORS.items():
        original = getattr(paddle.Tensor, dunder)
        set_attr(paddle.Tensor, dunder, _emulated(name, original))
    set_attr(_C_ops, "adamw_", _adam_on_master(_C_ops.adamw_))
    set_attr(_C_ops, "adam_", _adam_on_master(_C_ops.adam_))
    set_attr(paddle.Tensor, "_register_backward_hook", _register_backward_hook)
    for framework in (paddle.framework, paddle.base.framework):  # what recompute and SequenceTiled call
        set_attr(framework, "_dygraph_tracer", _tracer_view)
    for owner in (paddle.amp, _AMP):
        set_attr(owner, "decorate", decorate)
        set_attr(owner, "amp_decorate", decorate)
        set_attr(owner, "auto_cast", auto_cast)
        set_attr(owner, "amp_guard", auto_cast)
