"""A block's plan from its row bounds (attention/masks/block_mask.py), against the visibility matrix it stands for; the plans
kept per batch (attention/layout/batch_plans.py, api.ring_masks); the planning bench's counts."""
import numpy as np
import pytest
from workers.visibility import visible

from paddle_cp.attention.dispatch.api import ring_masks
from paddle_cp.attention.masks.mask import Mask
from paddle_cp.attention.layout.batch_plans import BatchPlans
from paddle_cp.attention.layout.sequence_layout import SequenceLayout
from paddle_cp.attention.masks.block_mask import BlockMask, Documents
from paddle_cp.tools import packing
from paddle_cp.tools.bench import planning as bench_planning

SEQ = 97


def _cases():
    rng = np.random.RandomState(0)
    doc_ids = np.stack([np.repeat(np.arange(SEQ), rng.randint(1, 12, SEQ))[:SEQ] for _ in range(2)])
    valid = np.ones((2, SEQ), bool)
    valid[1, 90:] = False
    layout = SequenceLayout("p2p", 3).for_batch(Documents.from_ids(doc_ids))
    assert layout.split.name == "documents"
    scattered = [layout.group_positions(SEQ, g) for g in range(3)]
    chunks = [SequenceLayout("p2p", 3).group_positions(SEQ, g) for g in range(3)]
    for positions in (scattered, chunks):
        for q in range(3):
            for k in range(3):
                yield positions[q], positions[k], dict(causal=True, doc_ids=doc_ids)
                yield positions[q], positions[k], dict(causal=False, doc_ids=doc_ids)
                yield positions[q], positions[k], dict(causal=True, window=7, valid=valid)
                yield positions[q], positions[k], dict(causal=True)


def _mask(q_pos, k_pos, causal, doc_ids=None, window=None, valid=None):
    documents = None if doc_ids is None else Documents.from_ids(doc_ids)
    return BlockMask(q_pos, k_pos, causal, documents, window=window, valid=valid, fragment=8)


def test_row_bounds_extent_and_tiles_are_the_visibility_matrix():
    for q_pos, k_pos, facts in _cases():
        mask = _mask(q_pos, k_pos, **facts)
        seen = visible(SEQ, **facts)[:, q_pos][:, :, k_pos]  # [b, q, k]
        rows = np.arange(len(q_pos))[None, :, None]
        by_bounds = (mask.start[:, None, :] <= rows) & (rows < mask.end[:, None, :])
        np.testing.assert_array_equal(np.broadcast_to(by_bounds, seen.shape), seen)

        extent = mask.extent()
        q_any, k_any = np.flatnonzero(seen.any(axis=(0, 2))), np.flatnonzero(seen.any(axis=(0, 1)))
        if not len(q_any):
            assert extent.kind == "none"
            continue
        assert extent.rows == (q_any[0], q_any[-1] + 1) and extent.keys == (k_any[0], k_any[-1] + 1)
        block = seen[:, extent.rows[0]:extent.rows[1], extent.keys[0]:extent.keys[1]]
        same = np.array_equal(q_pos[slice(*extent.rows)], k_pos[slice(*extent.keys)])
        expected = "all" if block.all() else (
            "diagonal" if facts["causal"] and same and (block == np.tri(block.shape[1], dtype=bool)).all() else "some")
        assert extent.kind == expected, (facts, extent)

        # flashmask's row indices: per key (first row past it, first row seeing it), from r0, over the extent
        indices = mask.row_indices(seen.shape[0]).numpy()
        r = np.arange(block.shape[1])[None, :, None]
        by_indices = (indices[:, 0, None, :, 1] <= r) & (r < indices[:, 0, None, :, 0])
        np.testing.assert_array_equal(np.broadcast_to(by_indices, block.shape), block)

        plan, computed = mask.tile_plan(8)
        planned = {(q_tile, k_tile): full for q_tile, seen_tiles in plan for k_tile, full in seen_tiles}
        assert [q_tile for q_tile, _ in plan] == mask.q_tiles(8)
        area = 0
        for q_tile in mask.q_tiles(8):
            for k_tile in mask.k_tiles(8):
                tile = seen[:, slice(*q_tile), slice(*k_tile)]
                assert ((q_tile, k_tile) in planned) == tile.any()
                if tile.any():
                    assert planned[(q_tile, k_tile)] == tile.all()
                    area += tile[0].size
        assert computed == area


def test_unsorted_query_positions_are_refused():
    with pytest.raises(ValueError, match="must ascend"):
        BlockMask(np.array([3, 1, 2]), np.arange(3), True)


def test_batch_plans_keep_a_batchs_masks_for_its_layers():
    plans = BatchPlans(kept=2)
    a, b = np.zeros(3), np.zeros(3)
    made = []

    def make():
        made.append(object())
        return made[-1]

    first = plans.get((a, 4, True, None), make)
    assert plans.get((a, 4, True, None), make) is first  # same facts: made once
    assert plans.get((b, 4, True, None), make) is not first  # an equal array of another batch is another batch
    assert plans.get((a, 5, True, None), make) is not first
    assert len(plans) == 2 and len(made) == 3  # the oldest batch forgotten

    positions = packing.packed_position_ids(np.array([5, 9, 2, 30, 7]), 64, 1)
    documents = Documents.from_position_ids(positions)
    layout = SequenceLayout("p2p", 2).for_batch(documents)
    masks = ring_masks(layout, 64, 0, Mask(True, documents=documents))
    assert ring_masks(layout, 64, 0, Mask(True, documents=documents)) is masks  # every layer of the batch
    assert masks.block(1) is masks.block(1)  # each ring step's mask made once
    assert ring_masks(layout, 64, 0, Mask(True, documents=Documents.from_position_ids(positions))) is not masks  # the next batch
    assert ring_masks(layout, 64, 0, Mask(True, 8, documents)) is not masks


def test_planning_bench_counts_one_call_per_visible_ring_step():
    results = bench_planning.run(16384, 4, "lognormal", row=1)
    assert [r["layout"] for r in results] == ["documents", "chunks"]  # the tile model's choice, then 2R chunks
    for r in results:
        assert len(r["op_calls_per_step"]) == 4 and set(r["op_calls_per_step"]) <= {0, 1}
        assert r["op_calls"] == sum(r["op_calls_per_step"]) and r["blockwise_tiles"] > 0
    # the chosen layout keeps these short documents whole on a rank: other ranks' keys are never seen
    assert results[0]["op_calls_per_step"] == [1, 0, 0, 0] and results[1]["op_calls"] == 3
