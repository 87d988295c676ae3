"""Attention pieces on one process: documents, tile masks, the blockwise kernel, the merge, kernel dispatch."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddle_cp.attention.kernels import BlockwiseKernel, FlashKernel, local_attention
from paddle_cp.attention.masks.block_mask import BlockMask, Documents
from paddle_cp.attention.algorithms.merge import merge


def test_documents_from_ids_positions_and_row_indices_agree():
    ids = np.array([[0, 0, 0, 1, 1, 2, 2, 2]])
    positions = np.array([[0, 1, 2, 0, 1, 0, 1, 2]])
    by_ids, by_positions = Documents.from_ids(ids), Documents.from_position_ids(positions)
    assert by_ids.start.tolist() == by_positions.start.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5]]
    assert by_ids.end.tolist() == by_positions.end.tolist() == [[3, 3, 3, 5, 5, 8, 8, 8]]
    rows = Documents.from_startend_row_indices(paddle.to_tensor(by_ids.end[:, None]))
    assert rows.end.tolist() == by_ids.end.tolist() and rows.causal_only
    with pytest.raises(ValueError, match="causal form"):
        Documents.from_startend_row_indices(np.zeros([1, 1, 8, 2]))


def test_masks_skip_tiles_no_query_sees():
    docs = Documents.from_ids(np.array([[0] * 4 + [1] * 4]))
    mask = BlockMask(np.arange(4, 8), np.arange(0, 4), causal=True, documents=docs)
    assert mask.classify((0, 4), (0, 4)) == "none"  # later document's queries, earlier document's keys
    causal = BlockMask(np.arange(4, 8), np.arange(0, 4), causal=True)
    assert causal.classify((0, 4), (0, 4)) == "all"
    assert BlockMask(np.arange(8), np.arange(8), causal=True).classify((0, 8), (0, 8)) == "diagonal"
    assert FlashKernel.expresses(causal) and not FlashKernel.expresses(
        BlockMask(np.arange(8), np.arange(8), causal=True, documents=docs))


@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_kernel_matches_sdpa(causal):
    paddle.seed(0)
    q, k, v = paddle.randn([2, 37, 6, 8]), paddle.randn([2, 37, 3, 8]), paddle.randn([2, 37, 3, 8])
    for t in (q, k, v):
        t.stop_gradient = False
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out = local_attention(q, k, v, causal, 8 ** -0.5, BlockwiseKernel(block_size=8))
    grad = paddle.randn(ref.shape)
    for got, want in zip(paddle.grad([out], [q, k, v], [grad]), paddle.grad([ref], [q, k, v], [grad])):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=1e-5)


def test_merge_equals_attention_over_both_blocks():
    paddle.seed(1)
    kernel = BlockwiseKernel()
    q, k, v = paddle.randn([1, 5, 2, 4]), paddle.randn([1, 10, 2, 4]), paddle.randn([1, 10, 2, 4])

    def attend(keys):
        mask = BlockMask(np.arange(5, 10), keys, causal=True)
        return kernel.forward(q, k[:, keys[0]:keys[-1] + 1], v[:, keys[0]:keys[-1] + 1], mask, 0.5)

    whole, whole_lse = attend(np.arange(10))
    out, lse = merge(*attend(np.arange(4)), *attend(np.arange(4, 10)))
    np.testing.assert_allclose(out.numpy(), whole.numpy(), atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), whole_lse.numpy(), atol=1e-6)
    # queries 5..7 see none of keys 8, 9: output 0, log-sum-exp -inf, and merging keeps the other part exact
    late_out, late_lse = attend(np.arange(8, 10))
    assert np.isneginf(late_lse.numpy()[:, :, :3]).all() and not late_out.numpy()[:, :3].any()
    out, lse = merge(*attend(np.arange(8)), late_out, late_lse)
    np.testing.assert_allclose(out.numpy(), whole.numpy(), atol=1e-6)


def test_flash_takes_no_tile_a_window_or_padding_cuts():
    """Tiles a window or padding cuts are neither empty, full nor plain causal: the blockwise kernel's."""
    assert FlashKernel.expresses(BlockMask(np.arange(8), np.arange(8), causal=True))
    assert not FlashKernel.expresses(BlockMask(np.arange(8), np.arange(8), causal=True, window=3))
    assert FlashKernel.expresses(BlockMask(np.arange(8), np.arange(8), causal=True, window=8))  # never bites
    padded = np.ones((1, 8), bool)
    padded[0, 6:] = False
    assert not FlashKernel.expresses(BlockMask(np.arange(8), np.arange(8), causal=True, valid=padded))


def test_window_and_padding_visibility():
    """Query i sees key j iff i - w < j <= i (PaddleFormers' sliding mask) and j is not padding."""
    valid = np.ones((2, 10), bool)
    valid[1, 8:] = False
    mask = BlockMask(np.arange(10), np.arange(10), causal=True, window=3, valid=valid)
    seen = mask.tile((0, 10), (0, 10)).numpy()[:, 0]
    i, j = np.arange(10)[:, None], np.arange(10)[None]
    expected = ((j <= i) & (j > i - 3))[None] & valid[:, None, :]
    np.testing.assert_array_equal(seen, expected)
    assert mask.classify((8, 10), (0, 4)) == "none"  # queries 8, 9 see keys 6..9 only


def test_attention_input_errors_name_the_fix():
    from paddle_cp.attention.dispatch.validation import check_inputs, check_sinks, check_window

    q, kv = paddle.zeros([1, 4, 4, 8]), paddle.zeros([1, 4, 2, 8])
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        check_inputs(q, kv, kv, 0.0, True, enable_gqa=False)
    check_inputs(q, kv, paddle.zeros([1, 4, 2, 6]), 0.0, True)  # MLA: v's head dim may differ
    with pytest.raises(ValueError, match="one logit per query head"):
        check_sinks(paddle.zeros([2]), q)
    with pytest.raises(ValueError, match="is_causal=True"):
        check_window(4, False)
