"""Paddle compatibility on one process: Paddle's plan objects translated, patch_paddle / unpatch_paddle,
the two-step API's checks, shard_dataloader with Paddle's signature, Paddle's global mesh."""
import sys
import types

import numpy as np
import paddle
import paddle.distributed as dist
import pytest
from paddle.distributed.auto_parallel.intermediate import parallelize as paddle_parallelize
from paddle.distributed.auto_parallel.intermediate.tensor_parallel import PlanBase

import paddle_cp as pcp
from paddle_cp.api.config import load_config
from paddle_cp.api.paddle_plans import SUPPORTED, translate
from paddle_cp.api.plan_keys import resolve_plan


def _hook_factory(process_mesh):
    return lambda layer, *args: None


TRANSLATIONS = [  # Paddle's object, the paddle_cp class it must become, the attributes that must carry over
    (dist.ColWiseParallel(gather_output=True), pcp.ColWiseParallel, {"gather_output": True}),
    (dist.ColWiseParallel(), pcp.ColWiseParallel, {"gather_output": False}),
    (dist.RowWiseParallel(is_input_parallel=False), pcp.RowWiseParallel, {"is_input_parallel": False}),
    (dist.RowWiseParallel(), pcp.RowWiseParallel, {"is_input_parallel": True}),
    (dist.SequenceParallelBegin(need_transpose=False), pcp.SequenceParallelBegin, {"need_transpose": False}),
    (dist.SequenceParallelEnd(need_transpose=False), pcp.SequenceParallelEnd, {"need_transpose": False}),
    (dist.SequenceParallelEnd(), pcp.SequenceParallelEnd, {"need_transpose": True}),
    (dist.SequenceParallelDisable(need_transpose=False), pcp.SequenceParallelDisable, {"need_transpose": False}),
    (dist.SequenceParallelEnable(), pcp.SequenceParallelEnable, {}),
    (dist.PrepareLayerInput(_hook_factory), pcp.PrepareLayerInput, {"fn": _hook_factory}),
    (dist.PrepareLayerOutput(_hook_factory), pcp.PrepareLayerOutput, {"fn": _hook_factory}),
    (dist.PrepareContextParallel("all2all"), pcp.PrepareContextParallel, {"backend": "all2all"}),
    (dist.PrepareContextParallel(), pcp.PrepareContextParallel, {"backend": "p2p"}),
    (dist.ContextParallel("all2all"), pcp.ContextParallel, {"backend": "all2all"}),
    (dist.ConvParallel(), pcp.ConvParallel, {}),
]


@pytest.mark.parametrize("paddle_plan, cls, attributes", TRANSLATIONS, ids=lambda v: repr(v)[:40])
def test_every_paddle_plan_translates_with_its_arguments(paddle_plan, cls, attributes):
    plan = translate("key", paddle_plan)
    assert type(plan) is cls
    assert {name: getattr(plan, name) for name in attributes} == attributes


def test_every_plan_class_of_paddles_api_is_known():
    names = {name for name in dist.__all__ if isinstance(getattr(dist, name), type)
             and issubclass(getattr(dist, name), PlanBase)}
    assert names == set(SUPPORTED)


def test_unknown_paddle_plan_is_a_type_error_naming_the_supported_ones():
    class MyPlan(PlanBase):
        pass

    class MyColWise(dist.ColWiseParallel):  # may override apply: not run as if it were Paddle's
        pass

    for plan in (MyPlan(), MyColWise()):
        with pytest.raises(TypeError, match="ColWiseParallel.*SequenceParallelEnd") as caught:
            resolve_plan(paddle.nn.Linear(2, 2), {"": plan})
        assert type(plan).__name__ in str(caught.value)


class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.up = paddle.nn.Linear(4, 8)
        self.down = paddle.nn.Linear(8, 4)


def test_paddle_and_paddle_cp_plans_mix_in_one_plan():
    matched = resolve_plan(Net(), {"up": [dist.ColWiseParallel(), pcp.PrepareLayerOutput(_hook_factory)],
                                   "down": pcp.RowWiseParallel(), "": dist.PrepareContextParallel("all2all")})
    got = [(name, [type(p) for p in plans]) for name, _, plans, _ in matched]
    assert got == [("", [pcp.PrepareContextParallel]), ("up", [pcp.ColWiseParallel, pcp.PrepareLayerOutput]),
                   ("down", [pcp.RowWiseParallel])]


def test_load_config_passes_paddle_plans_through():
    plan = {"up": dist.ColWiseParallel(), "down": "RowWiseParallel"}
    _, config = load_config({"mesh": {"shape": [1], "dim_names": ["mp"]}, "mp_config": {"parallelize_plan": plan}},
                            world_size=1)
    assert isinstance(config["mp_config"]["parallelize_plan"]["up"], dist.ColWiseParallel)


def test_split_point_is_paddles():
    assert pcp.SplitPoint is dist.SplitPoint


PATCHED = [(dist, "parallelize"), (dist, "shard_dataloader"), (dist, "shard_scaler"),
           (paddle_parallelize, "parallelize"), (paddle_parallelize, "parallelize_model"),
           (paddle_parallelize, "parallelize_optimizer")]


def test_patch_paddle_routes_every_entry_and_unpatch_restores_exactly():
    originals = {(m.__name__, n): getattr(m, n) for m, n in PATCHED}
    script = types.ModuleType("a_script")  # a script that imported Paddle's functions by name
    script.parallelize_model, script.shard_dataloader = paddle_parallelize.parallelize_model, dist.shard_dataloader
    sys.modules[script.__name__] = script
    try:
        pcp.patch_paddle()
        pcp.patch_paddle()  # idempotent
        assert dist.parallelize is pcp.parallelize and paddle_parallelize.parallelize is pcp.parallelize
        assert paddle_parallelize.parallelize_model is pcp.parallelize_model is script.parallelize_model
        assert paddle_parallelize.parallelize_optimizer is pcp.parallelize_optimizer
        assert dist.shard_dataloader is pcp.shard_dataloader is script.shard_dataloader
        assert dist.shard_scaler is pcp.shard_scaler
        pcp.unpatch_paddle()
        pcp.unpatch_paddle()
        assert {(m.__name__, n): getattr(m, n) for m, n in PATCHED} == originals
        assert script.parallelize_model is originals[("paddle.distributed.auto_parallel.intermediate.parallelize",
                                                      "parallelize_model")]
    finally:
        pcp.unpatch_paddle()
        del sys.modules[script.__name__]


def test_paddles_global_mesh_is_paddle_cps():
    mesh = dist.ProcessMesh([0], dim_names=["dp"])
    dist.auto_parallel.set_mesh(mesh)
    assert pcp.get_mesh() is mesh
    other = dist.ProcessMesh([0], dim_names=["sep"])
    pcp.set_mesh(other)
    assert dist.auto_parallel.get_mesh() is other


def test_two_step_api_refuses_an_optimizer_of_an_unparallelized_model():
    model = Net()
    assert pcp.parallelize_model(model, config={"dp_config": None}) is model  # nothing to do: unchanged
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
    assert pcp.parallelize_optimizer(optimizer, config=None) is optimizer
    with pytest.raises(ValueError, match="call parallelize_model first"):
        pcp.parallelize_optimizer(optimizer, config={"dp_config": {"sharding_level": 1}})


def _batches():
    ids = paddle.arange(24, dtype="int64").reshape([4, 6])
    return [{"input_ids": ids, "labels": ids + 100, "name": "x"}, [ids, ids + 1], (ids, [ids, ids])]


def test_shard_dataloader_takes_this_ranks_dp_part_of_every_form():
    mesh = dist.ProcessMesh([[1, 2], [0, 3]], dim_names=["dp", "mp"])  # this process (rank 0) is dp index 1
    loader = pcp.shard_dataloader(_batches(), meshes=[mesh], shard_dims="dp")
    assert len(loader) == 3
    by_call, by_iter = list(loader()), list(loader)
    rows = np.arange(24).reshape([4, 6])[2:]
    for batches in (by_call, by_iter):
        as_dict, as_list, as_tuple = batches
        assert sorted(as_dict) == ["input_ids", "labels", "name"] and as_dict["name"] == "x"
        np.testing.assert_array_equal(as_dict["labels"].numpy(), rows + 100)
        assert isinstance(as_list, list) and isinstance(as_tuple, tuple)
        np.testing.assert_array_equal(as_list[1].numpy(), rows + 1)
        np.testing.assert_array_equal(as_tuple[1][0].numpy(), rows)
    by_index = pcp.shard_dataloader(_batches(), mesh, shard_dims=0, input_keys=["labels"])
    assert list(next(iter(by_index))) == ["labels"]
    whole = next(iter(pcp.shard_dataloader(_batches(), mesh)))  # shard_dims=None: not split (Paddle's default)
    assert whole["input_ids"].shape == [4, 6]
    mp_split = next(iter(pcp.shard_dataloader(_batches(), mesh, shard_dims="mp")))
    np.testing.assert_array_equal(mp_split["input_ids"].numpy(), np.arange(24).reshape([4, 6])[:2])


def test_shard_dataloader_errors():
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    with pytest.raises(ValueError, match="shard_dims must be set"):
        pcp.shard_dataloader([], mesh, is_dataset_splitted=True)
    with pytest.raises(ValueError, match="split inputs of one batch differently"):
        pcp.shard_dataloader([], [mesh, mesh], shard_dims=["dp", None])
    with pytest.raises(TypeError, match="ProcessMesh"):
        pcp.shard_dataloader([], "dp")
    with pytest.raises(ValueError, match="does not split evenly"):
        list(pcp.shard_dataloader([paddle.zeros([3, 2])], mesh, shard_dims="dp"))


def test_two_step_api_checks_the_optimizer_matches_the_model():
    mesh = dist.ProcessMesh([0], dim_names=["dp"])
    config = {"dp_config": {"sharding_level": 1}}
    with pytest.warns(UserWarning, match=r"sharding_level 1 shards nothing: .* dp=1, sep=1"):
        model, other = pcp.parallelize_model(Net(), mesh, config), pcp.parallelize_model(Net(), mesh, config)
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
    with pytest.raises(ValueError, match="sharding_level 0 differs"):
        pcp.parallelize_optimizer(optimizer, config={"dp_config": {"sharding_level": 0}})
    with pytest.raises(ValueError, match=r"sharding_mesh_dim \['dp'\] differs from the \['dp', 'sep'\]"):
        pcp.parallelize_optimizer(optimizer, config={"dp_config": {"sharding_level": 1, "sharding_mesh_dim": "dp"}})
    with pytest.raises(ValueError, match="another mesh"):
        pcp.parallelize_optimizer(optimizer, dist.ProcessMesh([0], dim_names=["sep"]), config)
    with pytest.raises(ValueError, match="several parallelized models"):
        pcp.parallelize_optimizer(paddle.optimizer.AdamW(parameters=model.parameters() + other.parameters()),
                                  config=config)
    wrapped = pcp.parallelize_optimizer(optimizer, config=config)
    assert wrapped.inner is optimizer


def test_shard_sequence_takes_paddles_prepare_context_parallel():
    mesh = dist.ProcessMesh([0], dim_names=["sep"])
    x = paddle.arange(8).reshape([1, 8])
    got = pcp.shard_sequence(x, backend=dist.PrepareContextParallel("all2all"), mesh=mesh)
    np.testing.assert_array_equal(got.numpy(), pcp.shard_sequence(x, backend="all2all", mesh=mesh).numpy())


def test_dp_config_takes_paddles_sharding_mesh_dim():
    from paddle_cp.data_parallel.sharding import check_level, sharding_dims

    assert check_level({"sharding_level": 2, "sharding_mesh_dim": None}) == 2  # as PaddleFormers passes it
    assert check_level({"sharding_level": 1, "sharding_mesh_dim": "dp"}) == 1
    assert sharding_dims({"sharding_level": 1}) == ("dp", "sep")  # every rank holding a replica
    assert sharding_dims({"sharding_mesh_dim": "sep"}) == ("sep",)
    assert sharding_dims({"sharding_mesh_dim": ["dp", "cp"]}) == ("dp", "cp")
    for wrong in ("mp", [], ["dp", "dp"], 3):
        with pytest.raises(ValueError, match="give 'dp', 'sep' or a list of them"):
            check_level({"sharding_level": 1, "sharding_mesh_dim": wrong})
