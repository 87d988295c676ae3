"""The emulated flash_attn and flashmask_attention ops (tests/workers/emulated_flash.py) against an fp32
reference, FlashKernel and FlashMaskKernel selected and run on one CPU process under them, the dispatch rule."""
import math

import numpy as np
import paddle
import pytest
from paddle import _C_ops
from workers import emulated_flash

from paddle_cp.attention import kernels
from paddle_cp.attention.masks.block_mask import BlockMask, Documents

KERNEL = {kernel.name: kernel for kernel in kernels.KERNELS}

BF16_TOL = emulated_flash.RELATIVE_TOLERANCE[paddle.bfloat16]


def _reference(q, k, v, causal=False, seen=None):
    """fp32 attention [b, sq, hq, d] (GQA) and its lse [b, hq, sq], over the pairs `seen` (bool, broadcast to
    [b, hq, sq, sk]) or under a top-left causal mask; rows that see nothing: output 0."""
    q, k, v = (paddle.to_tensor(t.astype("float32").numpy()) for t in (q, k, v))
    for t in (q, k, v):
        t.stop_gradient = False
    group = q.shape[2] // k.shape[2]
    qh = q.transpose([0, 2, 1, 3])
    kh, vh = (t.transpose([0, 2, 1, 3]).repeat_interleave(group, axis=1) for t in (k, v))
    s = paddle.matmul(qh, kh, transpose_y=True) / math.sqrt(q.shape[3])
    if causal:
        seen = np.tri(q.shape[1], k.shape[1], dtype=bool)  # row i sees keys j <= i
    seen = paddle.to_tensor(np.ones(s.shape, bool) if seen is None else np.broadcast_to(seen, s.shape))
    s = paddle.where(seen, s, paddle.full([], -1e30, "float32"))
    lse = paddle.logsumexp(s, axis=-1)
    p = paddle.where(seen, paddle.exp(s - lse.unsqueeze(-1)), paddle.zeros_like(s))
    out = paddle.matmul(p, vh).transpose([0, 2, 1, 3])
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
        out = kernels.local_attention(*inputs, True, 0.3, kernel=KERNEL[name]())
        results[name] = [out, *paddle.grad([out], inputs, [paddle.ones_like(out)])]
    for got, want in zip(results["flash"], results["blockwise"]):
        assert _relative(got, want) < BF16_TOL


def test_emulated_flashmask_matches_fp32_reference():
    """Non-causal two-bound flashmask: key j is seen by rows [bounds[..., 1], bounds[..., 0]); per k/v head masks
    serve their GQA groups; a row that sees nothing gets out 0 and lse +inf; the lse buffer is [b, h, sq]."""
    paddle.seed(5)
    rng = np.random.RandomState(5)
    b, sq, sk, hq, hk, d = 2, 9, 7, 4, 2, 16
    q = paddle.randn([b, sq, hq, d]).astype("bfloat16")
    k, v = (paddle.randn([b, sk, hk, d]).astype("bfloat16") for _ in range(2))
    start = rng.randint(-2, sq, size=[b, hk, sk])  # negative: compared as uint32, so no row is below it
    end = rng.randint(0, sq + 3, size=[b, hk, sk])
    start[0, :, :] = np.maximum(start[0], 3)  # rows 0-2 of batch 0 see nothing
    bounds = paddle.to_tensor(np.stack([end, start], axis=-1), dtype="int32")
    row = np.arange(sq)[None, None, :, None]
    seen = (row >= np.where(start < 0, np.iinfo(np.uint32).max, start)[:, :, None]) & (row < end[:, :, None])
    seen = np.repeat(seen, hq // hk, axis=1)
    out, _, lse, seed_offset = emulated_flash.flashmask_attention(q, k, v, bounds, None, 0.0, False, False, False, "")
    inputs, ref_out, ref_lse = _reference(q, k, v, seen=seen)
    assert lse.shape == [b, hq, sq] and out.dtype == paddle.bfloat16
    assert _relative(out, ref_out) < BF16_TOL
    empty = ~seen.any(-1)
    assert empty[0, :, :3].all() and np.isinf(lse.numpy()[empty]).all() and (lse.numpy()[empty] > 0).all()
    np.testing.assert_allclose(lse.numpy()[~empty], ref_lse.numpy()[~empty], atol=2e-2)
    assert not out.astype("float32").numpy()[0, :3].any()
    dout = paddle.randn(out.shape).astype("bfloat16")
    grads = emulated_flash.flashmask_attention_grad(q, k, v, bounds, out, lse, seed_offset, dout, 0.0, False)
    ref_grads = paddle.grad([ref_out], list(inputs), [dout.astype("float32")])
    for got, want in zip(grads, ref_grads):
        assert _relative(got, want) < BF16_TOL
    with pytest.raises(ValueError, match="seed_offset"):
        emulated_flash.flashmask_attention_grad(q, k, v, bounds, out, lse, None, dout, 0.0, False)
    with pytest.raises(NotImplementedError, match="causal=False"):
        emulated_flash.flashmask_attention(q, k, v, bounds, None, 0.0, True, False, False, "")


def _masks(seq):
    """BlockMasks of one process's queries over its keys that flash_attn cannot express, by name."""
    positions = np.arange(seq)
    doc_ids = np.array([[0] * 50 + [1] * 40 + [2] * (seq - 90), [0] * 7 + [1] * (seq - 7)])
    valid = np.ones([2, seq], bool)
    valid[1, :5] = False  # padding keys: rows 0-4 of batch 1 see nothing
    return {
        "documents": BlockMask(positions, positions, True, Documents.from_ids(doc_ids), cuts=[seq // 2]),
        "documents.full": BlockMask(positions, positions, False, Documents.from_ids(doc_ids)),
        "window": BlockMask(positions, positions, True, window=37),
        "padding": BlockMask(positions, positions, True, cuts=[seq // 2], valid=valid),
    }


def test_flashmask_kernel_matches_blockwise_where_documents_cut_tiles(emulated_gpu, monkeypatch):
    """A block cut by documents, a window edge or padding runs as one flashmask call each way (never the
    blockwise kernel, never one call per tile); outputs and gradients agree with the blockwise kernel."""
    calls = {"flash_attn": 0, "flashmask_attention": 0, "flashmask_attention_grad": 0}
    for name in calls:
        op = getattr(_C_ops, name)
        monkeypatch.setattr(_C_ops, name, lambda *args, op=op, name=name: calls.__setitem__(name, calls[name] + 1)
                            or op(*args))
    paddle.seed(4)
    seq = 150
    q = paddle.randn([2, seq, 4, 16]).astype("bfloat16")
    k, v = (paddle.randn([2, seq, 2, 16]).astype("bfloat16") for _ in range(2))
    for name, mask in _masks(seq).items():
        assert isinstance(kernels.select_kernel(q, v, mask), kernels.FlashMaskKernel), name
        before = dict(calls)
        results = {}
        for kernel in ("flashmask", "blockwise"):
            inputs = [t.detach() for t in (q, k, v)]
            for t in inputs:
                t.stop_gradient = False
            out = kernels.local_attention(*inputs, True, 0.3, kernel=KERNEL[kernel](), mask=mask)
            results[kernel] = [out, *paddle.grad([out], inputs, [paddle.ones_like(out)])]
        for got, want in zip(results["flashmask"], results["blockwise"]):
            assert _relative(got, want) < BF16_TOL, name
        assert calls["flashmask_attention"] == before["flashmask_attention"] + 1, name
        assert calls["flashmask_attention_grad"] == before["flashmask_attention_grad"] + 1, name
    assert calls["flash_attn"] == 0  # the whole block, plain causal tiles included, is the flashmask call
    positions = np.arange(seq)
    assert isinstance(kernels.select_kernel(q, v, BlockMask(positions, positions, True)), kernels.FlashKernel)
    dense = BlockMask(positions, positions, False, dense=paddle.to_tensor(np.tri(seq, k=-3, dtype=bool)[None, None]))
    assert isinstance(kernels.select_kernel(q, v, dense), kernels.BlockwiseKernel)


def test_tiles_gather_short_runs_and_flashmask_takes_them(emulated_gpu):
    """A documents layout's short pieces share tiles (mask.tiles): the blockwise and flashmask kernels on such
    tiles of scattered positions agree with the blockwise kernel on one tile per run."""
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout
    from paddle_cp.attention.masks.block_mask import tiles
    from paddle_cp.attention.algorithms.ring import RingMasks
    from paddle_cp.attention.masks.mask import Mask
    from paddle_cp.tools import packing

    assert tiles([(0, 3), (3, 5), (5, 100), (100, 102)], 40, fragment=4) == [
        (0, 5), (5, 45), (45, 85), (85, 100), (100, 102)]
    assert tiles([(0, 3), (3, 5)], None, fragment=0) == [(0, 3), (3, 5)]
    positions = packing.packed_position_ids(np.array([12, 3, 2, 5, 58, 4, 3, 9]), 80, 2)
    documents = Documents.from_position_ids(positions)
    layout = SequenceLayout("p2p", 2).for_batch(documents)
    assert layout.split.name == "documents"
    groups = [layout.group_positions(80, g) for g in range(2)]
    paddle.seed(6)
    q = paddle.randn([2, len(groups[0]), 4, 16]).astype("bfloat16")
    k, v = (paddle.randn([2, len(groups[1]), 2, 16]).astype("bfloat16") for _ in range(2))
    results = {}
    for name, kernel, fragment in (("flashmask", "flashmask", 16), ("blockwise", "blockwise", 16),
                                   ("per_run", "blockwise", 0)):
        mask = RingMasks(groups, 0, Mask(True, documents=documents), layout.chunk_starts(80), fragment).block(1)
        inputs = [t.detach() for t in (q, k, v)]
        for t in inputs:
            t.stop_gradient = False
        out = kernels.local_attention(*inputs, True, 0.25, kernel=KERNEL[kernel](), mask=mask)
        results[name] = [out, *paddle.grad([out], inputs, [paddle.ones_like(out)])]
    assert len(mask.q_runs()) > len(RingMasks(groups, 0, Mask(True, documents=documents), fragment=16).block(1).q_tiles())
    for name in ("flashmask", "blockwise"):
        for got, want in zip(results[name], results["per_run"]):
            assert _relative(got, want) < BF16_TOL, name
