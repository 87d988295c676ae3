"""The emulated flash_attn op (tests/workers/emulated_flash.py) against an fp32 reference, and
FlashKernel selected and run on one CPU process under it."""
import math

import numpy as np
import paddle
import pytest
from workers import emulated_flash

from paddle_cp.attention import kernels

BF16_TOL = emulated_flash.RELATIVE_TOLERANCE[paddle.bfloat16]


def _reference(q, k, v, causal):
    """fp32 attention [b, sq, hq, d] with a top-left causal mask, GQA, and its lse [b, hq, sq]."""
    q, k, v = (paddle.to_tensor(t.astype("float32").numpy()) for t in (q, k, v))
    for t in (q, k, v):
        t.stop_gradient = False
    group = q.shape[2] // k.shape[2]
    qh = q.transpose([0, 2, 1, 3])
    kh, vh = (t.transpose([0, 2, 1, 3]).repeat_interleave(group, axis=1) for t in (k, v))
    s = paddle.matmul(qh, kh, transpose_y=True) / math.sqrt(q.shape[3])
    if causal:
        seen = np.tri(q.shape[1], k.shape[1], dtype=bool)  # row i sees keys j <= i
        s = paddle.where(paddle.to_tensor(seen), s, paddle.full([], -1e30, "float32"))
    lse = paddle.logsumexp(s, axis=-1)
    out = paddle.matmul(paddle.nn.functional.softmax(s, axis=-1), vh).transpose([0, 2, 1, 3])
    return (q, k, v), out, lse


def _relative(got, want):
    got, want = got.astype("float32").numpy(), want.astype("float32").numpy()
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("sq, sk, causal", [(130, 130, True), (130, 70, False), (3, 5, True), (7, 4, True)])
def test_emulated_flash_attn_matches_fp32_reference(sq, sk, causal):
    paddle.seed(0)
    b, hq, hk, d = 2, 4, 2, 16
    q = paddle.randn([b, sq, hq, d]).astype("bfloat16")
    k, v = (paddle.randn([b, sk, hk, d]).astype("bfloat16") for _ in range(2))
    out, _, lse, seed_offset = emulated_flash.flash_attn(q, k, v, None, None, 0.0, causal, False, False, "")
    inputs, ref_out, ref_lse = _reference(q, k, v, causal)
    assert out.dtype == paddle.bfloat16 and out.shape == [b, sq, hq, d]
    assert _relative(out, ref_out) < BF16_TOL
    rounded = -(-sq // 128) * 128
    assert lse.dtype == paddle.float32 and lse.shape == [b, hq, rounded]
    flat = lse.numpy().reshape(-1)
    # [b, hq, sq] packed at the start of the buffer; the rest never written
    np.testing.assert_allclose(flat[: b * hq * sq].reshape(b, hq, sq), ref_lse.numpy(), atol=2e-2)
    assert np.isnan(flat[b * hq * sq:]).all()
    assert np.isnan(lse.numpy()[:, :, :sq]).any(), "a plain slice would read unwritten values"
    assert seed_offset.numpy().tolist() == [0, 0]

    dout = paddle.randn(out.shape).astype("bfloat16")
    grads = emulated_flash.flash_attn_grad(q, k, v, out, lse, seed_offset, None, dout, 0.0, causal)
    ref_grads = paddle.grad([ref_out], list(inputs), [dout.astype("float32")])
    for got, want, like in zip(grads, ref_grads, (q, k, v)):
        assert got.dtype == paddle.bfloat16 and got.shape == like.shape
        assert _relative(got, want) < BF16_TOL


def test_emulated_causal_is_top_left_and_checks_arguments():
    # 2 queries, 4 keys, causal: query 0 sees key 0 only (bottom-right alignment would show it keys 0-2)
    v = paddle.to_tensor(np.arange(4 * 8, dtype="float32").reshape(1, 4, 1, 8)).astype("bfloat16")
    q, k = paddle.zeros([1, 2, 1, 8], "bfloat16"), paddle.zeros([1, 4, 1, 8], "bfloat16")
    out = emulated_flash.flash_attn(q, k, v, None, None, 0.0, True, False, False, "")[0].astype("float32").numpy()
    np.testing.assert_array_equal(out[0, 0, 0], np.arange(8))
    np.testing.assert_array_equal(out[0, 1, 0], np.arange(8) + 4)  # mean of keys 0 and 1
    lse = paddle.zeros([1, 1, 128])
    with pytest.raises(ValueError, match="seed_offset"):
        emulated_flash.flash_attn_grad(q, q, q, q, lse, None, None, q, 0.0, False)
    with pytest.raises(RuntimeError, match="not registered"):
        emulated_flash.flash_attn(q.astype("float32"), q, q, None, None, 0.0, False, False, False, "")


@pytest.fixture
def emulated_gpu(monkeypatch):
    emulated_flash.install(monkeypatch.setattr)


def test_selection_is_unchanged_without_the_emulation():
    q = paddle.zeros([1, 4, 2, 8], "bfloat16")
    assert isinstance(kernels.select_kernel(q, q), kernels.BlockwiseKernel)


def test_flash_kernel_runs_on_cpu_under_the_emulation(emulated_gpu):
    paddle.seed(3)
    q = paddle.randn([2, 130, 4, 16]).astype("bfloat16")  # 130: the lse buffer is padded to 256
    k, v = (paddle.randn([2, 130, 2, 16]).astype("bfloat16") for _ in range(2))
    assert isinstance(kernels.select_kernel(q, v), kernels.FlashKernel)
    assert isinstance(kernels.select_kernel(q.astype("float32"), v), kernels.BlockwiseKernel)
    mla_v = paddle.zeros([2, 130, 2, 8], "bfloat16")  # v head dim 8 != q/k's 16
    assert isinstance(kernels.select_kernel(q, mla_v), kernels.BlockwiseKernel)
    results = {}
    for name in ("flash", "blockwise"):
        inputs = [t.detach() for t in (q, k, v)]
        for t in inputs:
            t.stop_gradient = False
        out = kernels.local_attention(*inputs, True, 0.3, kernel=kernels._KERNELS[name]())
        results[name] = [out, *paddle.grad([out], inputs, [paddle.ones_like(out)])]
    for got, want in zip(results["flash"], results["blockwise"]):
        assert _relative(got, want) < BF16_TOL
