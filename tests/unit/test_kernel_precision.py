"""paddle_cp's own kernels compute in fp32 forward and backward, whatever the inputs' dtype and the caller's autocast.

CPU builds ignore autocast and have no bf16 compute kernels, so two stand-ins: `gpu_autocast` sets the
tracer's AMP level as `paddle.amp.auto_cast` sets it on a GPU and makes `paddle.matmul` act as a GPU's
autocast makes a white-list op act (inputs and result rounded to bf16); bf16 tensors go through the kernels
for real (they cast, CPU can: computing in fp32 inside is what makes them run at all). Checked: the blockwise
kernel, the log-sum-exp merge and the state-passing scan give under autocast exactly what they give outside it,
and on bf16 inputs the fp32 results on the upcast inputs rounded once; Paddle's per-dtype operator counter sees
no operator compute in bf16 inside them (casts and copies only).
"""
import contextlib

import numpy as np
import paddle
import pytest

from paddle_cp.api.operator_calls import operator_calls
from paddle_cp.attention.algorithms import state_passing
from paddle_cp.attention.kernels import BlockwiseKernel, local_attention
from paddle_cp.attention.masks.block_mask import BlockMask
from paddle_cp.attention.algorithms.merge import merge

BF16, FP32 = paddle.bfloat16, paddle.float32
SCALE = 16 ** -0.5
# operators that move or cast bf16 values without computing on them
MEMORY_OPS = {"cast", "transpose2", "reshape2", "slice", "concat", "assign", "contiguous", "full_like", "full",
              "squeeze2", "unsqueeze2", "split", "share_data"}


@contextlib.contextmanager
def gpu_autocast(level):
    """Autocast as a GPU runs it, for matmul: {"bf16": matmuls run in bf16, "fp32": matmuls run in fp32}."""
    tracer = paddle.base.framework._dygraph_tracer()
    saved_level, saved_dtype, matmul = tracer._amp_level, tracer._amp_dtype, paddle.matmul
    calls = {"bf16": 0, "fp32": 0}

    def autocast_matmul(x, y, *args, **kwargs):
        if tracer._amp_level == paddle.base.core.AmpLevel.O0:
            calls["fp32"] += 1
            return matmul(x, y, *args, **kwargs)
        calls["bf16"] += 1
        rounded = [t.astype(BF16).astype(FP32) for t in (x, y)]
        return matmul(*rounded, *args, **kwargs).astype(BF16)

    tracer._amp_level, tracer._amp_dtype = getattr(paddle.base.core.AmpLevel, level), "bfloat16"
    paddle.matmul = autocast_matmul
    try:
        yield calls
    finally:
        paddle.matmul = matmul
        tracer._amp_level, tracer._amp_dtype = saved_level, saved_dtype


def _qkv(seq=48, heads=4, kv_heads=2, dim=16, seed=0):
    paddle.seed(seed)
    return [paddle.randn([2, seq, h, dim]) for h in (heads, kv_heads, kv_heads, heads)]  # q, k, v, dout


def _mask(seq):
    return BlockMask(np.arange(seq), np.arange(seq), True)


def _equal(a, b):
    np.testing.assert_array_equal(a.astype(FP32).numpy(), b.astype(FP32).numpy())


def test_the_stand_in_autocast_rounds_a_matmul_outside_the_kernels():
    """The control: under gpu_autocast a matmul the kernels did not shield is rounded."""
    x, y, _, _ = _qkv()
    with gpu_autocast("O1") as calls:
        rounded = paddle.matmul(x[0, :, 0], y[0, :, 0], transpose_y=True)
    assert rounded.dtype == BF16 and calls == {"bf16": 1, "fp32": 0}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_blockwise_kernel_and_merge_compute_alike_under_autocast(level):
    q, k, v, dout = _qkv()
    kernel, mask = BlockwiseKernel(block_size=16), _mask(q.shape[1])
    out, lse = kernel.forward(q, k, v, mask, SCALE)
    grads = kernel.backward(dout, q, k, v, out, lse, mask, SCALE)
    half = [x[:, :24] for x in (q, k, v)]
    parts = [kernel.forward(half[0], half[1], half[2], BlockMask(np.arange(24), np.arange(24), False), SCALE),
             kernel.forward(half[0], k[:, 24:], v[:, 24:], BlockMask(np.arange(24), np.arange(24, 48), False), SCALE)]
    merged = merge(*parts[0], *parts[1])
    with gpu_autocast(level) as calls:
        out_ac, lse_ac = kernel.forward(q, k, v, mask, SCALE)
        grads_ac = kernel.backward(dout, q, k, v, out_ac, lse_ac, mask, SCALE)
        merged_ac = merge(*parts[0], *parts[1])
    assert calls["bf16"] == 0 and calls["fp32"] > 0
    for a, b in zip([out, lse, *grads, *merged], [out_ac, lse_ac, *grads_ac, *merged_ac]):
        assert b.dtype == FP32
        _equal(a, b)


def test_bf16_inputs_through_local_attention_are_the_fp32_results_rounded_once():
    q, k, v, dout = _qkv()
    low = [x.astype(BF16) for x in (q, k, v, dout)]
    wide = [x.astype(FP32) for x in low]  # the same values, upcast
    kernel, mask = BlockwiseKernel(block_size=16), _mask(q.shape[1])
    for x in low[:3]:
        x.stop_gradient = False
    with gpu_autocast("O2") as calls, operator_calls() as ops:
        out = local_attention(*low[:3], True, SCALE, kernel)
        grads = paddle.autograd.grad(out, low[:3], grad_outputs=low[3])
    assert calls["bf16"] == 0
    computed_in_bf16 = {op for op, counts in ops.items() if "bfloat16" in counts} - MEMORY_OPS
    assert not computed_in_bf16, computed_in_bf16
    assert out.dtype == BF16 and all(g.dtype == BF16 for g in grads)
    out_fp32, lse_fp32 = kernel.forward(*wide[:3], mask, SCALE)
    _equal(out, out_fp32.astype(BF16))
    # the backward reads the output it saved (in bf16, as flash saves it): the fp32 backward given that output
    saved_out = out_fp32.astype(BF16).astype(FP32)
    for g, g_fp32 in zip(grads, kernel.backward(wide[3], *wide[:3], saved_out, lse_fp32, mask, SCALE)):
        _equal(g, g_fp32.astype(BF16))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_state_passing_scan_computes_in_fp32_under_autocast_and_on_bf16(level):
    paddle.seed(3)
    b, n, h, dk, dv = 2, 6, 3, 4, 5
    out_zero, out_transition = paddle.randn([b, n, h, dv]), paddle.randn([b, n, h, dk])
    summaries = paddle.randn([3, b, h, dk, dk + dv]) * 0.5
    starts = np.array([12, 0, 6])

    def scan(o0, oa):
        entering = state_passing.entering_states(starts, summaries, last=12)
        return [entering[j] for j in sorted(entering)] + [state_passing.corrected(o0, oa, entering[0])]

    want = scan(out_zero, out_transition)
    low = [x.astype(BF16) for x in (out_zero, out_transition)]
    want_low = scan(*[x.astype(FP32) for x in low])
    with gpu_autocast(level) as calls, operator_calls() as ops:
        got = scan(out_zero, out_transition)
        got_low = scan(*low)
    assert calls["bf16"] == 0 and calls["fp32"] > 0
    assert not {op for op, counts in ops.items() if "bfloat16" in counts} - MEMORY_OPS
    for a, c in zip(want, got):
        _equal(a, c)
    for a, c in zip(want_low[:-1], got_low[:-1]):  # the entering states are fp32 whatever the outputs' dtype
        assert c.dtype == FP32
        _equal(a, c)
    assert got_low[-1].dtype == BF16
    _equal(got_low[-1], want_low[-1].astype(BF16))


@pytest.fixture
def emulated_amp(monkeypatch):
    from workers import emulated_amp

    emulated_amp.install(monkeypatch.setattr)
    yield emulated_amp
    emulated_amp.reset()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_under_the_emulated_amp_attention_and_the_scan_compute_as_outside_it(emulated_amp, level):
    """Paddle's AMP emulated on CPU (tests/workers/emulated_amp.py): a bf16 model's q/k/v through local_attention,
    forward under auto_cast and backward inside it too (as a pipeline's schedule runs it), give bit for bit
    what they give without autocast; so does the state-passing correction. The control: a matmul of the same
    fp32 values outside the kernels is rounded to bf16 under it."""
    q, k, v, dout = _qkv()
    with emulated_amp.auto_cast(level=level, dtype="bfloat16"):
        assert paddle.matmul(q[0, :, 0], k[0, :, 0], transpose_y=True).dtype == BF16

    def attention(autocast):
        low = [x.astype(BF16) for x in (q, k, v)]
        for x in low:
            x.stop_gradient = False
        with autocast:
            out = local_attention(*low, True, SCALE, BlockwiseKernel(block_size=16))
            return [out, *paddle.autograd.grad(out, low, grad_outputs=dout.astype(BF16))]

    for got, want in zip(attention(emulated_amp.auto_cast(level=level, dtype="bfloat16")),
                         attention(contextlib.nullcontext())):
        assert got.dtype == BF16
        _equal(got, want)
    out_zero, out_transition, state = paddle.randn([2, 6, 3, 5]), paddle.randn([2, 6, 3, 4]), paddle.randn([2, 3, 4, 5])
    with emulated_amp.auto_cast(level=level, dtype="bfloat16"):
        got = state_passing.corrected(out_zero, out_transition, state)
    _equal(got, state_passing.corrected(out_zero, out_transition, state))
