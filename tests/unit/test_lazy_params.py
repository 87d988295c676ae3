"""A lazily built parameter through the sharding record: its shape follows the plans without memory, and
initialize() keeps exactly this rank's part of one card's draw (single process: one-rank groups and
hand-made records stand in for the mesh)."""
import numpy as np
import paddle

from paddle_cp.api.lazy_init import defer_initialization
from paddle_cp.mesh import MeshGroup
from paddle_cp.params import Owned, record_of, release_value, shard_parameter, store_local_value

ALONE = MeshGroup((0,), 0, None)


def _lazy_linear():
    paddle.seed(7)
    with paddle.LazyGuard():
        return paddle.nn.Linear(3, 12)


def _one_card():
    layer = _lazy_linear()
    for p in layer.parameters():
        p.initialize()
    return layer.weight.numpy(), paddle.rand([1]).item()  # and the next draw after the loop


def test_fused_slice_is_cut_from_one_cards_draw():
    full, next_draw = _one_card()
    for index in range(2):
        layer = _lazy_linear()
        assert defer_initialization(layer, ALONE)
        weight = layer.weight
        shard_parameter(weight, 1, MeshGroup((0, 1), index, None), (8, 2, 2))  # q|k|v parts
        assert list(weight.shape) == [3, 6] and not weight._is_initialized()
        for p in layer.parameters():
            p.initialize()
        assert (weight.numpy() == record_of(weight).local(full)).all()
        assert paddle.rand([1]).item() == next_draw  # the random state moved as one card's did


def test_level3_non_owner_draws_and_keeps_the_placeholder():
    full, next_draw = _one_card()
    layer = _lazy_linear()
    defer_initialization(layer, ALONE)
    replicas = MeshGroup((0, 1), 0, None)
    record_of(layer.weight).place(Owned(replicas, replicas, None, 1, 3))
    release_value(layer.weight)
    assert list(layer.weight.shape) == [0] and not layer.weight._is_initialized()
    for p in layer.parameters():
        p.initialize()
    assert list(layer.weight.shape) == [0] and layer.weight._init_func is None  # as the eager placeholder
    assert paddle.rand([1]).item() == next_draw


def test_a_loader_sets_a_lazy_parameter_without_drawing():
    layer = _lazy_linear()
    defer_initialization(layer, ALONE)
    shard_parameter(layer.weight, 1, MeshGroup((0, 1), 1, None))
    value = np.arange(18, dtype="float32").reshape(3, 6)
    store_local_value(layer.weight, value)
    assert (layer.weight.numpy() == value).all() and layer.weight._init_func is None
