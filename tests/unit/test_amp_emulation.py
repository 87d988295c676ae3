"""The CPU emulation of Paddle's GPU mixed precision (tests/workers/emulated_amp.py) against what its sources
say: kernels in fp32 on rounded inputs with rounded outputs, decorate's casts, autocast's lists, master
gradients accumulated in fp32, multi-precision AdamW on the master weight."""
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
import emulated_amp  # noqa: E402

BF16 = paddle.bfloat16


@pytest.fixture(autouse=True)
def emulation(monkeypatch):
    emulated_amp.install(monkeypatch.setattr)
    yield
    emulated_amp.reset()


def rounded(x, dtype=BF16):
    return x.astype(dtype).astype("float32")


def test_a_half_kernel_computes_in_fp32_on_its_inputs_and_rounds_once():
    paddle.seed(1)
    x, w = paddle.randn([3, 8]), paddle.randn([8, 5])
    xb, wb = x.astype(BF16), w.astype(BF16)
    xb.stop_gradient = wb.stop_gradient = False
    out = paddle.matmul(xb, wb)
    assert out.dtype == BF16
    np.testing.assert_array_equal(out.astype("float32").numpy(),
                                  rounded(paddle.matmul(rounded(x), rounded(w))).numpy())
    out.astype("float32").sum().backward()
    assert xb.grad.dtype == BF16  # the grad kernel's output in the input's dtype
    want = rounded(paddle.matmul(paddle.ones([3, 5]), rounded(w), transpose_y=True))
    np.testing.assert_array_equal(xb.grad.astype("float32").numpy(), want.numpy())
    assert (xb + xb).dtype == BF16 and (xb * 2.0).dtype == BF16  # operators too (no CPU bf16 `add` kernel)


@pytest.mark.parametrize("view", [
    lambda x: paddle.slice(x, axes=[0, 1], starts=[1, 0], ends=[2, 3]),  # what Paddle's flex-checkpoint loader writes
    lambda x: paddle.strided_slice(x, axes=[1], starts=[0], ends=[4], strides=[2]),
    lambda x: paddle.transpose(x, [1, 0]), lambda x: paddle.reshape(x, [4, 3]), lambda x: paddle.flatten(x),
    lambda x: paddle.unsqueeze(x, 0), lambda x: paddle.squeeze(paddle.unsqueeze(x, 0), 0),
    lambda x: paddle.unbind(x, 0)[1],
])
def test_a_view_of_a_half_tensor_stays_a_view(view):
    """Paddle's stride kernels share the input's memory in every dtype: a write through the view reaches it."""
    x = paddle.zeros([3, 4], dtype=BF16)
    with paddle.no_grad():
        part = view(x)
        paddle.assign(paddle.ones(part.shape, dtype=BF16), part)
    assert float(x.astype("float32").sum()) == part.size


def test_decorate_o2_casts_as_amp_initialize_and_o1_changes_nothing():
    def model():
        return paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.LayerNorm(4), paddle.nn.BatchNorm1D(4))

    kept = model()
    assert paddle.amp.decorate(kept, level="O1", dtype="bfloat16") is kept
    assert {p.dtype for p in kept.parameters()} == {paddle.float32}
    def dtypes(layers):
        return [{p.dtype for p in layer.parameters()} for layer in layers]

    bf16 = paddle.amp.decorate(model(), level="O2", dtype="bfloat16")
    assert dtypes(bf16) == [{BF16}, {BF16}, {paddle.float32}]  # BatchNorm (its statistics too) kept
    fp16 = paddle.amp.decorate(model(), level="O2", dtype="float16")
    assert dtypes(fp16) == [{paddle.float16}, {paddle.float32}, {paddle.float32}]  # LayerNorm too


def test_autocast_follows_paddles_lists():
    x = paddle.randn([2, 4])
    w = paddle.randn([4, 4])
    with paddle.amp.auto_cast(level="O1", dtype="bfloat16"):
        y = paddle.matmul(x, w)  # white list
        assert y.dtype == BF16
        assert paddle.nn.functional.softmax(y).dtype == paddle.float32  # O1 black list
        assert (y + x).dtype == paddle.float32  # promoted: an fp32 input
        assert (y * y).dtype == BF16
    with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
        assert paddle.nn.functional.softmax(y).dtype == BF16  # O2 blacks out only EXTRA_BLACK_LIST
    assert paddle.matmul(x, w).dtype == paddle.float32  # outside: nothing cast


def test_recompute_replays_the_forward_under_its_autocast():
    """Paddle's recompute reads the tracer's AMP state in forward and re-enters auto_cast for the replay."""
    from paddle.distributed.fleet.utils import recompute

    paddle.seed(4)
    layer = paddle.nn.Linear(4, 4)
    x = paddle.randn([2, 4])
    x.stop_gradient = False
    grads = []
    for recomputed in (False, True):
        x.clear_gradient()
        with paddle.amp.auto_cast(level="O1", dtype="bfloat16"):
            y = recompute(layer, x) if recomputed else layer(x)
        assert y.dtype == BF16
        y.astype("float32").sum().backward()
        grads.append(x.grad.numpy())
    np.testing.assert_array_equal(grads[0], grads[1])
    assert paddle.framework._dygraph_tracer()._amp_level == paddle.base.core.AmpLevel.O0


def test_master_gradients_accumulate_in_fp32_over_backwards():
    paddle.seed(2)
    layer = paddle.nn.Linear(8, 8)
    opt = paddle.optimizer.AdamW(parameters=layer.parameters(), multi_precision=True)
    layer, opt = paddle.amp.decorate(layer, opt, level="O2", dtype="bfloat16", master_grad=True)
    xs = [paddle.randn([4, 8]) for _ in range(3)]
    seen = []
    layer.weight._register_backward_hook(lambda: seen.append(layer.weight.grad.dtype))  # after accumulation
    for x in xs:
        with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
            loss = layer(x).astype("float32").sum()
        loss.backward()
        assert layer.weight.grad.dtype == paddle.float32
    # each backward's bf16 weight gradient x^T 1, rounded once, summed in fp32
    want = sum(rounded(paddle.matmul(rounded(x), paddle.ones([4, 8]), transpose_x=True)) for x in xs)
    np.testing.assert_array_equal(layer.weight.grad.numpy(), want.numpy())
    assert seen == [BF16, paddle.float32, paddle.float32]  # readers after accumulation see the fp32 sum


def test_multi_precision_adamw_steps_the_master_and_rounds_the_parameter():
    paddle.seed(3)
    reference = paddle.nn.Linear(4, 4)
    layer = paddle.nn.Linear(4, 4)
    layer.set_state_dict(reference.state_dict())
    ref_opt = paddle.optimizer.AdamW(learning_rate=0.1, parameters=reference.parameters())
    opt = paddle.optimizer.AdamW(learning_rate=0.1, parameters=layer.parameters(), multi_precision=True)
    layer, opt = paddle.amp.decorate(layer, opt, level="O2", dtype="bfloat16", master_grad=True)
    for p, q in zip(reference.parameters(), layer.parameters()):
        p.set_value(rounded(p))  # the master starts from the bf16 parameter
        grad = paddle.full(p.shape, 0.25)
        p.grad, q.grad = None, None
        p._set_grad_ivar(grad)
        q._set_grad_ivar(grad)
    ref_opt.step()
    opt.step()
    for p, q in zip(reference.parameters(), layer.parameters()):
        np.testing.assert_allclose(opt._master_weights[q.name].numpy(), p.numpy(), rtol=1e-6)
        np.testing.assert_array_equal(q.astype("float32").numpy(), rounded(p).numpy())


def test_in_place_ops_write_their_input():
    x = paddle.zeros([4, 2]).astype(BF16)
    updates = paddle.to_tensor([[1.0, 2.0], [3.0, 4.0]]).astype(BF16)
    assert paddle.scatter_(x, paddle.to_tensor([1, 3]), updates, overwrite=True) is x
    np.testing.assert_array_equal(x.astype("float32").numpy(), [[0, 0], [1, 2], [0, 0], [3, 4]])
    x.add_(paddle.ones([4, 2]).astype(BF16))
    assert x.dtype == BF16 and float(x.astype("float32").sum()) == 18.0
