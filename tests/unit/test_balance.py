"""The documents layout as pure functions: per-rank attention work within 1.05x of the mean on the
main job's documents and on a long-tailed distribution (N = 4) and on simulated larger meshes, for
documents of any length; every position on exactly one rank, local lengths within a few tokens."""
import numpy as np
import pytest

from paddle_cp.attention.layout import SequenceLayout
from paddle_cp.attention.mask import Documents
from paddle_cp.tools import packing

BOUND = 1.05


def layouts(backend, world, position_ids, degree=None):
    """(chunks layout, documents layout) of one batch."""
    chunks = SequenceLayout(backend, world, degree)
    return chunks, chunks.for_batch(Documents.from_position_ids(position_ids))


def check_partition(layout, seq_len):
    held = [layout.positions(seq_len, rank) for rank in range(layout.world)]
    assert np.array_equal(np.sort(np.concatenate(held)), np.arange(seq_len))
    assert all(len(p) >= 1 and np.all(np.diff(p) > 0) for p in held)
    return max(map(len, held)) - min(map(len, held))


@pytest.mark.parametrize("source, seq_len, batch, steps, world, uncapped", [
    ("stdlib", 4096, 1, 20, 4, False),     # the main job: 20 steps of one 4096-token row, 4 ranks
    ("lognormal", 8192, 1, 20, 4, False),  # long-tailed lengths, median 600
    ("stdlib", 4096, 4, 5, 4, False),      # four rows sharing one layout
    ("stdlib", 32768, 1, 4, 8, True),      # simulated larger meshes, uncapped file lengths
    ("stdlib", 131072, 1, 1, 16, True),
    ("lognormal", 131072, 1, 1, 16, False),
])
def test_documents_layout_balances_work(source, seq_len, batch, steps, world, uncapped, monkeypatch):
    if uncapped:
        monkeypatch.setitem(packing.LENGTHS, "stdlib", lambda: packing.stdlib_lengths(cap=10 ** 9))
    old, new = [], []
    for position_ids in packing.batches(source, seq_len, batch, steps):
        chunks, balanced = layouts("p2p", world, position_ids)
        old.append(packing.imbalance(packing.rank_work(chunks, position_ids)))
        new.append(packing.imbalance(packing.rank_work(balanced, position_ids)))
        assert (balanced.split.name == "documents") == (old[-1] > BOUND)  # chunks kept where they balance
        assert check_partition(balanced, seq_len) <= 2 * world  # local lengths within a few tokens
    assert max(new) <= BOUND, new
    assert np.mean(old) > 1.15  # the 2N chunks alone leave it unbalanced


def test_documents_shorter_than_2n_and_hybrid_and_row_indices():
    rng = np.random.default_rng(1)
    tiny = packing.packed_position_ids(rng.integers(1, 8, 5000), 1024, 4)  # every document < 2N = 8 tokens
    chunks, kept = layouts("p2p", 4, tiny)
    assert kept is chunks and packing.imbalance(packing.rank_work(chunks, tiny)) <= BOUND  # already balanced
    uneven = np.concatenate([tiny[:1, :512], packing.packed_position_ids(np.array([512]), 512, 1)], axis=1)
    _, balanced = layouts("p2p", 4, uneven)  # short documents, then one long one: chunks do not balance that
    assert balanced.split.name == "documents" and packing.imbalance(packing.rank_work(balanced, uneven)) <= 1.01
    assert check_partition(balanced, 1024) <= 8
    # hybrid: ring groups of two Ulysses ranks; a group's positions split contiguously over them
    positions = packing.batches("lognormal", 4096, 2, 1)[0]
    _, hybrid = layouts("hybrid", 4, positions, degree=2)
    assert hybrid.split.name == "documents" and hybrid.ring == 2
    assert packing.imbalance(packing.rank_work(hybrid, positions)) <= BOUND
    check_partition(hybrid, 4096)
    # PaddleFormers' causal row indices describe the same documents: the same layout
    documents = Documents.from_position_ids(positions)
    from_rows = Documents.from_startend_row_indices(documents.end[:, None])
    assert np.array_equal(documents.keys_seen(), from_rows.keys_seen())
    base = SequenceLayout("p2p", 4)
    by_ids, by_rows = base.for_batch(documents), base.for_batch(from_rows)
    assert all(np.array_equal(by_ids.positions(4096, r), by_rows.positions(4096, r)) for r in range(4))


def test_chunks_where_documents_cannot_help():
    positions = packing.batches("stdlib", 64, 1, 1)[0]
    ulysses = SequenceLayout("all2all", 4)
    assert ulysses.for_batch(Documents.from_position_ids(positions)) is ulysses  # one ring group: nothing to balance
    p2p = SequenceLayout("p2p", 4)
    assert p2p.for_batch(Documents.from_position_ids(positions), "chunks") is p2p
    one_document = SequenceLayout("p2p", 4).for_batch(Documents.from_position_ids(np.arange(9)[None]))
    check_partition(one_document, 9)  # 9 tokens: pieces of one token, every rank holds some
    with pytest.raises(ValueError, match="unknown sequence layout"):
        p2p.for_batch(None, "even")
