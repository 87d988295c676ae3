"""The parameter record as placements: fused and uneven shards, the boxes a rank holds, and what each
placement says about reducing, counting, writing and holding (one process: hand-made groups stand in for
the mesh)."""
import numpy as np
import paddle
import pytest

from paddle_cp.mesh import MeshGroup
from paddle_cp.params import (AFTER_SHARDING, BEFORE_SHARDING, SHARDING, Box, Held, Owned, ParamRecord, Partial,
                              Reduction, Replicate, Shard, local_boxes, record_of, shard_parameter)


def _group(index, size=2, ranks=None):
    return MeshGroup(tuple(ranks or range(size)), index, None)


def _fused(index):
    return ParamRecord(full_shape=(2, 12), placements=[Shard(_group(index), 1, (8, 2, 2))])


def test_fused_layout_round_trips():
    full = np.arange(2 * 12).reshape(2, 12)
    records = [_fused(i) for i in range(2)]
    local = [r.local(full) for r in records]
    assert local[0].tolist()[0] == [0, 1, 2, 3, 8, 10]  # q heads 0-1, k half, v half
    shard = records[0].shards()[0]
    assert (shard.assemble(local) == full).all()
    gathered_rank_major = np.concatenate(local, axis=1)
    assert (gathered_rank_major[:, shard.column_order()] == full).all()


def test_uneven_shard_pieces_differ_by_at_most_one_and_round_trip():
    """Stacked experts [5, 2, 3] over 3 ranks: ranges of 2, 2 and 1 experts along axis 0."""
    full = np.arange(5 * 2 * 3).reshape(5, 2, 3)
    records = [ParamRecord((5, 2, 3), [Shard(_group(i, 3), 0, (5,))]) for i in range(3)]
    assert [r.local_shape() for r in records] == [(2, 2, 3), (2, 2, 3), (1, 2, 3)]
    local = [r.local(full) for r in records]
    assert (local[2] == full[4:]).all()
    shard = records[0].shards()[0]
    assert (shard.assemble(local) == full).all()
    assert (np.concatenate(local, axis=0)[shard.column_order()] == full).all()
    assert [b.global_offset for r in records for b in r.boxes()] == [(0, 0, 0), (2, 0, 0), (4, 0, 0)]


def test_two_shards_make_the_product_of_their_pieces():
    """Experts split over one group along axis 0, each expert's columns over another along axis 2."""
    full = np.arange(4 * 2 * 6).reshape(4, 2, 6)
    for e in range(2):
        for m in range(2):
            record = ParamRecord((4, 2, 6), [Shard(_group(e), 0, (4,)), Shard(_group(m, ranks=(5, 6)), 2, (6,))])
            local = record.local(full)
            assert local.shape == (2, 2, 3)
            np.testing.assert_array_equal(local, full[2 * e:2 * e + 2, :, 3 * m:3 * m + 3])
            assert len(record.boxes()) == 1


def test_record_is_created_once_and_describes_the_single_card_parameter():
    param = paddle.nn.Linear(4, 6).weight
    record = record_of(param)
    assert record is record_of(param)
    assert record == ParamRecord(full_shape=(4, 6))
    assert local_boxes(param) == [Box((0, 0), (4, 6), (slice(0, 4), slice(0, 6)))]


def test_record_refuses_a_misspelt_field():
    record = record_of(paddle.nn.Linear(4, 6).weight)
    with pytest.raises(AttributeError, match="sequence_partial"):
        record.sequence_partial = True
    assert not hasattr(record, "sequence_partial")


def test_fused_shard_boxes_place_every_local_column_in_the_global_tensor():
    full = np.arange(2 * 12, dtype="float32").reshape(2, 12)
    for index in range(2):
        param = paddle.create_parameter([2, 12], "float32")
        param.set_value(full)
        shard_parameter(param, 1, _group(index), (8, 2, 2))
        local = param.numpy()
        assert local.shape == (2, 6) and record_of(param).full_shape == (2, 12)
        boxes = local_boxes(param)
        assert [b.local_shape for b in boxes] == [(2, 4), (2, 1), (2, 1)]
        for box in boxes:
            window = tuple(slice(o, o + n) for o, n in zip(box.global_offset, box.local_shape))
            np.testing.assert_array_equal(local[box.local_slice], full[window])
        assert sum(local[b.local_slice].size for b in boxes) == local.size


def test_level3_non_owner_holds_no_box():
    param = paddle.nn.Linear(4, 6).weight
    record = record_of(param)
    replicas = _group(1)
    record.place(Owned(replicas, replicas, None, 0, 3))
    assert local_boxes(param) == [] and record.held_here() and not record.steps_here()
    record.placements = [Owned(replicas, replicas, None, 0, 2)]  # levels 1-2 shard state and gradients, not the value
    assert len(local_boxes(param)) == 1


def test_each_placement_says_how_the_gradient_is_completed():
    dp, sep, mp, pp, pair = _group(0), _group(1, ranks=(4, 5)), _group(0, ranks=(6, 7)), _group(0, 3), _group(0)
    record = ParamRecord((4,), [Partial(mp, "sum"), Held(pp, (0, 2), pair), Partial(dp, "avg")])
    assert record.reductions() == [Reduction(AFTER_SHARDING, mp, "sum"), Reduction(BEFORE_SHARDING, pair, "sum"),
                                   Reduction(AFTER_SHARDING, dp, "avg")]
    owned = Owned(dp, dp, sep, 0, 2)  # sharded over dp only, the owners' gradients still averaged over sep
    record.replace(record.placements[2], owned)
    assert owned.reductions() == [Reduction(SHARDING, dp, "avg"), Reduction(AFTER_SHARDING, sep, "avg")]
    assert Owned(dp, dp, None, 0, 1).reductions() == [Reduction(AFTER_SHARDING, dp, "avg")]  # all-reduce, then step
    assert Held(pp, (1,)).reductions() == [] and not Held(pp, (1,)).holds()


def test_one_rank_counts_and_writes_each_piece():
    """Counting (seed 0) and writing (a key's hash) pick one rank among those holding equal copies."""
    shard = Shard(_group(1), 1, (4,))
    assert shard.chosen(seed=0, split=True) and not shard.chosen(seed=0, split=False)  # a scalar beside it
    assert Replicate(_group(1)).chosen(seed=3, split=True) and not Replicate(_group(1)).chosen(0, True)
    assert Held(_group(2, 3), (0, 2)).chosen(0, True) is False and Held(_group(0, 3), (0, 2)).chosen(5, True)
    owned = Owned(_group(1, 4), _group(1), _group(0, ranks=(8, 9)), 1, 1)
    assert owned.chosen(0, True) and not owned.chosen(1, True)
    record = ParamRecord((4, 4), [shard, Replicate(_group(0, ranks=(2, 3)))])
    assert record.chosen_here() and not record.chosen_here(seed=1)


def test_a_partial_gradient_replaces_a_replica_and_is_refused_on_a_shard():
    mp = _group(0)
    record = ParamRecord((4,), [Replicate(mp)])
    record.mark_partial(mp)
    assert record.placements == [Partial(mp, "sum")]
    record.mark_partial(mp)
    assert record.placements == [Partial(mp, "sum")]
    with pytest.raises(ValueError, match="split over ranks"):
        ParamRecord((4,), [Shard(mp, 0, (4,))]).mark_partial(mp)
    with pytest.raises(ValueError, match="already"):
        record.place(Shard(mp, 0, (4,)))


def test_full_values_come_from_the_last_placed_first():
    pp, dp = _group(1, 2, ranks=(0, 2)), _group(0)
    record = ParamRecord((4,), [Held(pp, (0, 1)), Owned(dp, dp, None, 1, 3)])
    assert record.value_sources() == [(dp, 1), (pp, 0)]
