"""The documents layout as pure functions (attention/packed_layout.py), priced by the GPU tile model:
on held-out document mixes (seeds and orders the layout was not tuned on) over 4 and 8 ranks and
32K-256K tokens, its slowest rank costs at most 1.02x the cheaper of 2R chunks and the whole-document
layout, and less than both where a mix allows; no ring group holds more than 1.05 x S/R tokens; every
position is on exactly one rank, on every backend; the function balance_gpu.py prices loads by path."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from paddle_cp.attention import packed_layout
from paddle_cp.attention.layout import SequenceLayout
from paddle_cp.attention.mask import Documents
from paddle_cp.attention.tile_cost import document_ends
from paddle_cp.tools import packing


def held_out(name, seed=7):
    rng = np.random.default_rng(seed)
    if name == "lognormal600":
        return np.maximum(1, np.round(rng.lognormal(np.log(600), 1.0, 20000))).astype(np.int64)
    if name == "stdlib":  # the main job's capped file lengths, in a shuffled order
        return rng.permutation(packing.stdlib_lengths())
    if name == "longtail":
        return np.maximum(1, np.round(rng.lognormal(np.log(2000), 1.5, 20000))).astype(np.int64)
    if name == "one_document":
        return np.array([10 ** 7])
    return rng.integers(1, 4000, 20000)  # uniform


def check_partition(layout, seq_len):
    held = [layout.positions(seq_len, rank) for rank in range(layout.world)]
    assert np.array_equal(np.sort(np.concatenate(held)), np.arange(seq_len))
    assert all(len(p) >= 1 and np.all(np.diff(p) > 0) for p in held)
    return max(map(len, held))


@pytest.mark.parametrize("name", ["lognormal600", "stdlib", "longtail", "one_document", "uniform"])
def test_default_layout_never_costs_more_than_chunks_or_whole_documents(name):
    ratios = {}
    for ring in (4, 8):
        for seq_len in (32768, 131072, 262144):
            position_ids = packing.packed_position_ids(held_out(name), seq_len, 2)[1:]  # the stream's second row
            documents = Documents.from_position_ids(position_ids)
            chosen, priced = packed_layout.choose(documents.end, documents.keys_seen(), ring)
            cheaper = min(priced["chunks"].slowest_ms, priced["whole"].slowest_ms)
            ratios[ring, seq_len] = chosen.slowest_ms / cheaper
            assert chosen.counts.tokens.max() <= 1.05 * seq_len / ring
            assert chosen.counts.tokens.sum() == seq_len and np.isin(chosen.groups, np.arange(ring)).all()
    assert max(ratios.values()) <= 1.02, ratios
    if name in ("lognormal600", "uniform"):  # short and long documents mixed: some cut, the rest whole
        assert min(ratios.values()) < 0.97, ratios


def test_every_backend_holds_every_token_once_within_the_memory_bound():
    for position_ids in (packing.batches("lognormal", 8192, 2, 1)[0], packing.batches("stdlib", 4096, 1, 1)[0]):
        documents = Documents.from_position_ids(position_ids)
        seq_len = position_ids.shape[1]
        for backend, world, degree in (("p2p", 4, None), ("p2p", 8, None), ("hybrid", 8, 2), ("all2all", 4, None)):
            layout = SequenceLayout(backend, world, degree).for_batch(documents)
            ring_tokens = [len(layout.group_positions(seq_len, g)) for g in range(layout.ring)]
            assert max(ring_tokens) <= packed_layout.token_cap(seq_len, layout.ring)
            rank_cap = -(-packed_layout.token_cap(seq_len, layout.ring) // layout.ulysses)
            assert check_partition(layout, seq_len) <= rank_cap


def test_small_batches_and_row_indices():
    rng = np.random.default_rng(1)
    tiny = packing.packed_position_ids(rng.integers(1, 8, 5000), 1024, 4)  # every document < 2N = 8 tokens
    check_partition(SequenceLayout("p2p", 4).for_batch(Documents.from_position_ids(tiny)), 1024)
    one_document = SequenceLayout("p2p", 4).for_batch(Documents.from_position_ids(np.arange(9)[None]))
    check_partition(one_document, 9)  # 9 tokens: every rank holds some
    # PaddleFormers' causal row indices describe the same documents: the same layout
    positions = packing.batches("lognormal", 4096, 2, 1)[0]
    documents = Documents.from_position_ids(positions)
    from_rows = Documents.from_startend_row_indices(documents.end[:, None])
    base = SequenceLayout("p2p", 4)
    by_ids, by_rows = base.for_batch(documents), base.for_batch(from_rows)
    assert all(np.array_equal(by_ids.positions(4096, r), by_rows.positions(4096, r)) for r in range(4))
    assert base.for_batch(documents) is by_rows  # the same batch again (inputs, then labels): chosen once
    with pytest.raises(ValueError, match="unknown sequence layout"):
        base.for_batch(None, "even")
    assert SequenceLayout("all2all", 4).for_batch(documents).split.name == "chunks"  # one ring group


def test_documents_cut_only_at_tile_boundaries_where_cut():
    position_ids = packing.packed_position_ids(held_out("lognormal600"), 131072, 1)
    documents = Documents.from_position_ids(position_ids)
    chosen, _ = packed_layout.choose(documents.end, documents.keys_seen(), 8)
    starts, lengths = packed_layout.segments(documents.end)
    for start, length in zip(starts, lengths):
        groups = chosen.groups[start:start + length]
        inner_cuts = np.flatnonzero(np.diff(groups)) + 1  # where the document passes to another group
        assert (inner_cuts % packed_layout.TILE == 0).all(), (start, length, inner_cuts)


def test_the_gpu_script_loads_the_layout_function_by_path():
    """shared/gpu/balance_gpu.py --layout mine=paddle_cp/attention/packed_layout.py:ring_groups loads the file
    alone (no package, no Paddle) and calls it with (position in document, document id, R)."""
    path = Path(packed_layout.__file__)
    spec = importlib.util.spec_from_file_location("priced_layout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert {line.split()[1].split(".")[0] for line in path.read_text().splitlines()
            if line.startswith(("import ", "from "))} <= {"__future__", "numpy", "time", ""}  # "": numpy-only siblings
    position_ids = packing.batches("lognormal", 16384, 1, 1)[0]
    pos = position_ids[0]
    doc = np.cumsum(pos == 0) - 1
    groups = module.ring_groups(pos, doc, 4)
    end = document_ends(pos, doc)[None]
    assert np.array_equal(groups, packed_layout.choose(end, (pos + 1)[None], 4)[0].groups)
