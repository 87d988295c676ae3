"""ParallelDims: every named group of a mesh made once, in one fixed order, before any plan applies; the plans
take their groups from it. Paddle's new_group is recorded here (rank 0 of 8, no process started)."""
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
