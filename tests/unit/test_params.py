"""The sharding record of a parameter: tensor-parallel slicing of fused weights and the boxes a rank holds."""
import numpy as np
import paddle
import pytest

from paddle_cp.mesh import MeshGroup
from paddle_cp.params import Box, ParamRecord, local_boxes, record_of, shard_parameter


def _fused(index):
    return ParamRecord(full_shape=(2, 12), tp_axis=1, tp_parts=(8, 2, 2), mp_group=MeshGroup((0, 1), index, None))


def test_fused_layout_round_trips():
    full = np.arange(2 * 12).reshape(2, 12)
    records = [_fused(i) for i in range(2)]
    local = [r.local(full) for r in records]
    assert local[0].tolist()[0] == [0, 1, 2, 3, 8, 10]  # q heads 0-1, k half, v half
    assert (records[0].assemble(local) == full).all()
    gathered_rank_major = np.concatenate(local, axis=1)
    assert (gathered_rank_major[:, records[0].column_order()] == full).all()


def test_record_is_created_once_and_describes_the_single_card_parameter():
    param = paddle.nn.Linear(4, 6).weight
    record = record_of(param)
    assert record is record_of(param)
    assert record == ParamRecord(full_shape=(4, 6))
    assert local_boxes(param) == [Box((0, 0), (4, 6), (slice(0, 4), slice(0, 6)))]


def test_record_refuses_a_misspelt_field():
    record = record_of(paddle.nn.Linear(4, 6).weight)
    record.mp_partial = True
    with pytest.raises(AttributeError, match="sequence_partial"):
        record.sequence_partial = True
    assert not hasattr(record, "sequence_partial")


def test_fused_shard_boxes_place_every_local_column_in_the_global_tensor():
    full = np.arange(2 * 12, dtype="float32").reshape(2, 12)
    for index in range(2):
        param = paddle.create_parameter([2, 12], "float32")
        param.set_value(full)
        shard_parameter(param, 1, MeshGroup((0, 1), index, None), (8, 2, 2))
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
    record.dp_group, record.dp_owner, record.level = MeshGroup((0, 1), 1, None), 0, 3
    assert local_boxes(param) == []
    record.level = 2  # levels 1-2 shard optimizer state and gradients, not the value
    assert len(local_boxes(param)) == 1
