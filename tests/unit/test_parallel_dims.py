"""ParallelDims: the groups a run declares made once, in one fixed order, before any plan applies, and no
others; the plans, the pipeline, completion and sharding take their groups from it. Paddle's new_group is
recorded here (rank 0 of 8 or 16, no process started)."""
import contextlib

import paddle.distributed as dist
import pytest

from paddle_cp import mesh as mesh_lib
from paddle_cp import runtime
from paddle_cp.api.parallelize import _parallel_dims
from paddle_cp.plans import ColWiseParallel, ContextParallel, PrepareContextParallel
from paddle_cp.plans.context_parallel import SepRun
from paddle_cp.plans.same_batch import BatchCheck
from paddle_cp.plans.tensor_parallel import _mp_group

MESH = dict(mesh=[[[0, 1], [2, 3], [4, 5], [6, 7]]], dim_names=["dp", "sep", "mp"])  # dp1 x sep4 x mp2


@pytest.fixture
def created(monkeypatch):
    """The rank lists new_group is called with, in order; the process's groups start empty."""
    calls = []

    def new_group(ranks):
        calls.append(tuple(ranks))
        return object()

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: None)
    monkeypatch.setattr(mesh_lib, "_own_store", contextlib.nullcontext)  # no store: new_group is recorded
    for name in ("groups", "process_groups", "parallel_dims"):
        monkeypatch.setattr(runtime.installed, name, {})
    return calls


def _applications(layer):
    return [(PrepareContextParallel("hybrid", 2), layer, ()), (ContextParallel("hybrid", 2), layer, ()),
            (ColWiseParallel(), layer, ())]


def test_parallelize_makes_each_group_once_before_the_plans_apply(created):
    import paddle

    mesh = dist.ProcessMesh(**MESH)
    layer = paddle.nn.Linear(4, 4)
    dims = _parallel_dims(mesh, _applications(layer))
    made = list(created)
    assert len(made) == len(set(made)), made  # each set of ranks once
    # rank 0's groups: sep [0 2 4 6], mp [0 1], world (the default group, no rendezvous), the sep parts
    # [0 2] (Ulysses) and [0 4] (ring); every other rank's slices are made too, in the same order
    assert {(0, 2, 4, 6), (0, 1), (0, 2), (0, 4)} <= set(made) and (0, 1, 2, 3, 4, 5, 6, 7) not in made
    assert mesh_lib.dims_of(mesh) is dims and runtime.installed.parallel_dims

    # the plans read their groups from it: nothing more is made
    run = SepRun(ContextParallel("hybrid", 2), dims)
    assert run.groups.sep is dims.with_pairs("sep") and (run.groups.ulysses, run.groups.ring) == dims.sep_parts(2)
    assert run.groups.ulysses.ranks == (0, 2) and run.groups.ring.ranks == (0, 4)
    assert _mp_group(ColWiseParallel(), dims) is dims.mp and dims.mp.ranks == (0, 1)
    check = BatchCheck(dims)
    assert check.stage is dims.stage and check.replica_group is dims.replica and check.replica == 0
    assert _parallel_dims(mesh, _applications(layer)) is dims
    assert created == made


def test_the_order_of_creation_does_not_depend_on_the_plans_order(created):
    import paddle

    layer = paddle.nn.Linear(4, 4)
    _parallel_dims(dist.ProcessMesh(**MESH), _applications(layer))
    first = list(created)
    created.clear()
    for name in ("groups", "process_groups", "parallel_dims"):
        getattr(runtime.installed, name).clear()
    _parallel_dims(dist.ProcessMesh(**MESH), _applications(layer)[::-1])
    assert created == first


def test_a_mesh_without_sep_is_refused_before_any_group(created):
    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
    with pytest.raises(ValueError, match="sep"):
        ContextParallel().apply(None, mesh)
    assert created == []


def test_only_the_groups_the_run_declares_are_made(created):
    """dp2 x sep2 x mp2 with ContextParallel and ColWise: data, sep and mp slices, each once; no dp, stage or
    replica groups (no PrepareContextParallel checks batches, no sharding cuts the replicas), no pp."""
    import paddle

    mesh = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["dp", "sep", "mp"])
    layer = paddle.nn.Linear(4, 4)
    dims = _parallel_dims(mesh, [(ContextParallel(), layer, ()), (ColWiseParallel(), layer, ())])
    assert sorted(created) == sorted([(0, 2, 4, 6), (1, 3, 5, 7),  # data: dp x sep
                                      (0, 2), (1, 3), (4, 6), (5, 7),  # sep
                                      (0, 1), (2, 3), (4, 5), (6, 7)])  # mp; world is the default group
    assert not any(key[1] in (("pp",), ("dp",)) for key in dims.built()), dims.built()

    # PrepareContextParallel's batch check compares over a stage and a replica (sep x mp): made with it
    created.clear()
    for name in ("groups", "process_groups", "parallel_dims"):
        getattr(runtime.installed, name).clear()
    _parallel_dims(mesh, [(PrepareContextParallel(), layer, ()), (ContextParallel(), layer, ())])
    assert {(0, 1, 2, 3), (4, 5, 6, 7)} <= set(created) and (0, 4) not in created


def test_the_sites_read_their_groups_from_parallel_dims(created, monkeypatch):
    """After the build, completion, sharding's cut, the pipeline's placement, the sequence and tensor plans,
    the sharded-input check and the batch check take every group from ParallelDims: the mesh helpers raise
    from then on, so a site cutting the mesh by dim names itself fails here."""
    import types

    import numpy as np
    import paddle

    from paddle_cp.api.plan_annotation import PlanAnnotation
    from paddle_cp.data_parallel.sharding import data_replicas, sharding_groups_needed, split_replicas
    from paddle_cp.params import Held, Partial, Replicate, complete_placements, record_of
    from paddle_cp.pipeline import pipeline_groups_needed
    from paddle_cp.pipeline.ownership import holders, place_on_stages
    from paddle_cp.plans import SequenceParallelBegin
    from paddle_cp.plans.sharded_inputs import ShardedInputsCheck

    monkeypatch.setattr(dist, "get_world_size", lambda: 16)
    mesh = dist.ProcessMesh(np.arange(16).reshape(2, 2, 2, 2).tolist(), dim_names=["pp", "dp", "sep", "mp"])
    first, second = paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 4)
    second.weight = first.weight  # tied: held by both stages
    model = paddle.nn.Sequential(first, second)
    stages = types.SimpleNamespace(stages=2, chunks=1, units=[("0", first, 0), ("1", second, 1)],
                                   rank_of=lambda virtual: virtual)
    sharded, norm = paddle.nn.Linear(4, 4), paddle.nn.LayerNorm(4)
    applications = [(PrepareContextParallel(), model, ()), (ContextParallel(), model, ()),
                    (ColWiseParallel(), sharded, ()), (SequenceParallelBegin(), first, ())]
    annotation = PlanAnnotation(partial_gradients=[norm.weight])
    dims = _parallel_dims(mesh, applications, annotation, pipeline_groups_needed(model, stages),
                          sharding_groups_needed(1, mesh, ("dp",)))
    built = list(created)

    def refuse():
        raise AssertionError("a group cut from the mesh after ParallelDims was built")

    # every mesh helper (mesh_group, fold_groups, split_dim_groups, line_subgroups, however imported) starts here
    monkeypatch.setattr(mesh_lib, "ensure_initialized", refuse)

    annotation.apply(dims)
    for plan, layer, params in applications[2:]:
        plan.apply(layer, dims, params)
    place_on_stages(dims, holders(model, stages), dims.pp)
    tied = record_of(first.weight).find(Held)[0]
    assert tied.positions == (0, 1) and tied.holders is dims.line("pp", (0, 1)) and tied.group is dims.pp
    for param in (*model.parameters(), sharded.weight, norm.weight):
        complete_placements(param, dims)
    assert data_replicas(record_of(first.weight)).group is dims.data
    assert [p.group for p in record_of(first.bias).find(Replicate)] == [dims.mp]  # pp: Held by its stage
    assert [p.group for p in record_of(sharded.weight).find(Replicate)] == [dims.pp]  # mp: sharded
    assert [(p.group, p.reduce) for p in record_of(norm.weight).find(Partial)] == [(dims.mp, "sum"), (dims.data, "avg")]
    assert split_replicas(dims, data_replicas(record_of(sharded.weight)), ("dp",)) == (dims.dp, dims.sep)
    check = ShardedInputsCheck(dims, "model")
    assert check.group is dims.sep and check.world is dims.world
    batch = BatchCheck(dims)
    assert batch.stage is dims.stage and batch.replica_group is dims.replica and batch.replica == 0
    assert dims.stage.ranks == tuple(range(8)) and dims.replica.ranks == (0, 1, 2, 3)
    assert created == built


def test_experts_folded_on_part_of_the_data_dims_declare_the_rest_for_completion(created, monkeypatch):
    """Experts folded over sep only: completion averages them over dp, a group the expert plan declares."""
    import paddle

    from paddle_cp.params import Partial, complete_placements, record_of
    from paddle_cp.plans.expert_parallel import ExpertFold, ExpertParallel

    mesh = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["dp", "sep", "mp"])
    plan = ExpertParallel().folded(ExpertFold(2, ("sep",)))
    assert ("group", ("dp",)) in plan.groups_needed(None, mesh)
    dims = _parallel_dims(mesh, [(plan, None, ())])
    inner, outer = dims.fold(("sep",), 2)
    expert = paddle.create_parameter([2, 4], "float32")
    record_of(expert).place(Partial(outer, "avg"))
    monkeypatch.setattr(mesh_lib, "ensure_initialized", lambda: pytest.fail("a group made after the build"))
    complete_placements(expert, dims)
    assert [p.group for p in record_of(expert).find(Partial)] == [outer, dims.dp] and dims.dp.ranks == (0, 4)
