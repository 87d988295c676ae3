"""The exchange plan (attention/layout/exchange_plan.py): the k/v rows each ring member's tiles read from each
other member equal a brute-force reading of the dense mask (every query against every key), on one causal
document, packed documents of several length mixes, sliding windows and padding; and the bytes it implies."""
import numpy as np
import pytest

from paddle_cp.attention.layout.exchange_plan import ExchangePlan, exchange_bytes
from paddle_cp.attention.layout.sequence_layout import SequenceLayout
from paddle_cp.attention.masks.block_mask import Documents
from paddle_cp.tools import packing

SEQ = 1536


def dense_visible(seq_len, causal, doc_ids=None, window=None, valid=None):
    """bool [b, S, S]: query i sees key j, from the definitions (no row bounds)."""
    i, j = np.arange(seq_len)[:, None], np.arange(seq_len)[None]
    seen = (j <= i) if causal else np.ones((seq_len, seq_len), bool)
    seen = seen[None]
    if doc_ids is not None:
        seen = seen & (doc_ids[:, :, None] == doc_ids[:, None, :])
    if window is not None:
        seen = seen & (i - window < j)[None]
    if valid is not None:
        seen = seen & valid[:, None, :]
    return seen


def brute_force_rows(visible, positions, receiver, sender, tile):
    """The sender's local rows in a tile holding some key a receiver's query sees (in any batch row)."""
    if receiver == sender:
        return np.zeros(0, np.int64)
    block = visible[:, positions[receiver]][:, :, positions[sender]]  # [b, receiver's queries, sender's keys]
    seen_tiles = np.unique(np.flatnonzero(block.any(axis=(0, 1))) // tile)
    local = np.arange(len(positions[sender]))
    return local[np.isin(local // tile, seen_tiles)]


def doc_ids_of(position_ids):
    return np.cumsum(position_ids == 0, axis=1)


def _documents_case(lengths, rows=1, backend="p2p", world=4, degree=None):
    position_ids = packing.packed_position_ids(np.asarray(lengths), SEQ, rows)
    documents = Documents.from_position_ids(position_ids)
    layout = SequenceLayout(backend, world, degree).for_batch(documents)
    return layout, documents, doc_ids_of(position_ids)


def cases():
    """(name, ring positions, causal, documents, doc ids, window, valid)."""
    chunks = SequenceLayout("p2p", 4)
    yield "causal one document", chunks.ring_positions(SEQ), True, None, None, None, None
    yield "full attention", chunks.ring_positions(SEQ), False, None, None, None, None
    mixes = {"short": [37, 120, 64, 200, 90, 15, 300], "bimodal": [40, 700, 25, 30, 900, 60],
             "long and short": [1100, 20, 50, 300], "uniform": [96] * 16}
    for name, lengths in mixes.items():
        layout, documents, ids = _documents_case(lengths)
        yield f"packed {name}", layout.ring_positions(SEQ), True, documents, ids, None, None
    layout, documents, ids = _documents_case([200, 500, 31, 77], rows=2)
    yield "packed, two rows", layout.ring_positions(SEQ), True, documents, ids, None, None
    layout, documents, ids = _documents_case([60, 700, 45, 300], backend="hybrid", world=8, degree=2)
    yield "packed, hybrid", layout.ring_positions(SEQ), True, documents, ids, None, None
    ids = np.repeat(np.arange(6), SEQ // 6)[None]
    yield "documents, not causal", chunks.ring_positions(SEQ), False, Documents.from_ids(ids), ids, None, None
    yield "sliding window", chunks.ring_positions(SEQ), True, None, None, 100, None
    layout, documents, ids = _documents_case([300, 250, 600, 80])
    yield "window in documents", layout.ring_positions(SEQ), True, documents, ids, 130, None
    valid = np.ones((2, SEQ), bool)
    valid[0, 1200:], valid[1, :300] = False, False
    yield "padding", chunks.ring_positions(SEQ), True, None, None, None, valid


CASES = list(cases())


@pytest.mark.parametrize("tile", [1, 16, 128])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plan_rows_equal_brute_force(case, tile):
    _, positions, causal, documents, ids, window, valid = case
    plan = ExchangePlan(positions, causal, documents, window, valid, tile=tile)
    visible = dense_visible(SEQ, causal, ids, window, valid)
    ring = len(positions)
    for receiver in range(ring):
        for sender in range(ring):
            expected = brute_force_rows(visible, positions, receiver, sender, tile)
            assert plan.rows(receiver, sender).tolist() == expected.tolist(), (receiver, sender)
            assert plan.counts[receiver, sender] == len(expected)


def test_causal_document_reads_three_quarters_of_the_whole_blocks():
    """2R chunks of one causal document: member r's first chunk is read by every other member, its second
    by the r members before it, so the members send 0.75 of the whole blocks' bytes between them."""
    ring = 8
    positions = SequenceLayout("p2p", ring).ring_positions(2 * ring * 256)
    plan = ExchangePlan(positions, True, tile=128)
    assert plan.counts.sum(axis=0).tolist() == [256 * (ring - 1 + r) for r in range(ring)]
    sent = exchange_bytes(plan, kv_row_bytes=512, grad_row_bytes=512)
    assert sent.whole_blocks.tolist() == [3 * 7 * 512 * 512] * ring  # 7 blocks of 512 rows, three times
    assert sent.planned.sum() == sent.read.sum() == 0.75 * sent.whole_blocks.sum()


def test_documents_kept_whole_read_nothing():
    layout, documents, _ = _documents_case([96] * 16)
    plan = ExchangePlan(layout.ring_positions(SEQ), True, documents, tile=128)
    assert plan.counts.sum() == 0
    assert exchange_bytes(plan, 512, 1024).planned.sum() == 0


def test_window_reads_its_halo():
    """A window of w keys over 2R chunks: each chunk reads the w - 1 keys before it, rounded out to tiles."""
    window, tile = 100, 16
    positions = SequenceLayout("p2p", 4).ring_positions(SEQ)
    plan = ExchangePlan(positions, True, window=window, tile=tile)
    halo = -(-(window - 1) // tile) * tile
    assert plan.counts.sum(axis=1).max() <= 2 * halo
    # each chunk but the first reads one halo, but chunks R-1 and R are one member's
    assert plan.counts.sum() == 6 * halo


def test_bytes_count_gradients_in_their_dtype():
    positions = SequenceLayout("p2p", 4).ring_positions(SEQ)
    plan = ExchangePlan(positions, True)
    sent = exchange_bytes(plan, kv_row_bytes=256, grad_row_bytes=512)
    lengths = plan.lengths()
    assert sent.whole_blocks.tolist() == [2 * (SEQ - lengths[(r + 1) % 4]) * 256 + (SEQ - lengths[r]) * 512
                                   for r in range(4)]
    assert sent.planned.tolist() == (2 * plan.counts.sum(axis=0) * 256 + plan.counts.sum(axis=1) * 512).tolist()


@pytest.mark.parametrize("window", [128, 4096])
def test_sliding_window_moves_its_halo(window):
    """Mistral's and GPT-OSS's windows over 65,536 tokens on 8 ranks (2N chunks of 4096): each rank receives and
    sends at most 2 x window k/v rows a direction (one halo a chunk), where whole blocks move 7 blocks of 8192."""
    positions = SequenceLayout("p2p", 8).ring_positions(65536)
    plan = ExchangePlan(positions, True, window=window)
    assert plan.counts.sum(axis=1).max() == plan.counts.sum(axis=0).max() == 2 * window
    sent = exchange_bytes(plan, 512, 512)
    assert sent.planned.sum() == 3 * 512 * plan.counts.sum() <= sent.whole_blocks.sum() * 2 * window / (7 * 8192)


def test_rows_selected_exactly_in_every_dtype():
    """The planned exchange's row selection (fp16 on CPU, which Paddle's CPU build cannot index_select, goes
    through fp32, exactly)."""
    import paddle

    from paddle_cp.attention.algorithms.planned_exchange import _select_rows

    x = paddle.randn([2, 7, 3, 4])
    rows = paddle.to_tensor(np.array([0, 3, 6]))
    for dtype in (paddle.float32, paddle.bfloat16, paddle.float16):
        got = _select_rows(x.astype(dtype), rows)
        assert got.dtype == dtype
        assert np.array_equal(got.astype("float32").numpy(), x.astype(dtype).astype("float32").numpy()[:, [0, 3, 6]])


def test_dense_masks_share_the_batchs_exchange_plan():
    """A dense mask is a layer's tensor, so masks with one are made per call; the exchange plan reads only the
    row bounds, so every layer of the batch reads the one plan its first made."""
    import paddle

    from paddle_cp.attention.dispatch.api import ring_masks
    from paddle_cp.attention.masks.mask import Mask

    layout, seq = SequenceLayout("p2p", 4), 64
    rows = len(layout.ring_positions(seq)[1])
    dense = [paddle.ones([1, 1, rows, seq], "bool") for _ in range(2)]
    first, second = (ring_masks(layout, seq, 1, Mask(dense=d)) for d in dense)
    assert first is not second and first.mask.dense is dense[0] and second.mask.dense is dense[1]
    assert first.exchange() is second.exchange() is ring_masks(layout, seq, 1, Mask()).exchange()
    assert len(layout.plans) == 1
