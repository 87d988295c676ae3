"""parallelize on one process: Paddle's plan-key matching, and bad configs refused before any collective."""
import warnings
from typing import Callable, NamedTuple

import paddle
import paddle.distributed as dist
import pytest

import paddle_cp as pcp
from paddle_cp.api.plan_keys import resolve_plan


class Block(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.proj = paddle.nn.Linear(2, 2)


class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.layers = paddle.nn.LayerList([Block(), Block()])
        self.head = paddle.nn.Linear(2, 2)


class Attention(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.qkv_proj = paddle.nn.Linear(8, 24)


class Tied(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = paddle.nn.Embedding(16, 8)
        self.head = paddle.nn.Linear(16, 8)
        self.head.weight = self.embed.weight


def test_plan_keys_match_like_paddle():
    plan = pcp.ContextParallel()
    matched = resolve_plan(Net(), {"layers.*.proj": plan, "head.weight": plan, "": plan})
    assert [(name, params) for name, _, _, params in matched] == [
        ("", []), ("layers.0.proj", []), ("layers.1.proj", []), ("head", ["weight"])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # fullmatch: "proj" is not "layers.0.proj"; a key matching nothing warns, as Paddle ignores it
        found = resolve_plan(Net(), {"proj": pcp.TokenWise(), "layers.*.proj": plan})
    assert [name for name, _, _, _ in found] == ["layers.0.proj", "layers.1.proj"]
    assert "layers.0.proj" in str(caught[0].message)


def test_context_plans_matching_no_layer_are_refused():
    """A model whose layers are named otherwise than the plan's keys: no sequence split anywhere, every sep rank
    would run the whole sequence. The keys' closest names are in the error."""
    with pytest.raises(ValueError, match=r"no context-parallel plan applies to Net: 'proj' .*'layers.0.proj'"):
        resolve_plan(Net(), {"": pcp.TokenWise(), "proj": pcp.ContextParallel()})


def _dp_mesh():
    return dist.ProcessMesh([0], dim_names=["dp"])


def _mp_mesh():
    return dist.ProcessMesh([0, 1], dim_names=["mp"])


def _mp_plan(plan):
    return {"mp_config": {"parallelize_plan": plan}}


def _cp_plan(plan):
    return {"cp_config": {"parallelize_plan": plan}}


class BadCall(NamedTuple):
    name: str
    call: Callable[[], object]
    error: type
    message: str  # what the error must name


BAD_CALLS = [
    BadCall("unknown_config_key", lambda: pcp.parallelize(Net(), config={"tp_config": {}}, mesh=_dp_mesh()),
            ValueError, "unknown parallelize config keys"),
    BadCall("plan_given_as_string", lambda: pcp.parallelize(
        Net(), mesh=_dp_mesh(), config=_cp_plan({"head": "ContextParallel"})), TypeError, "paddle_cp plan"),
    BadCall("mesh_without_sep", lambda: pcp.parallelize(
        Net(), mesh=_dp_mesh(), config=_cp_plan({"head": pcp.ContextParallel()})), ValueError,
        r"a mesh dim named 'sep' \('cp' is accepted too\)"),
    BadCall("same_plan_in_mp_and_cp", lambda: pcp.parallelize(
        Net(), mesh=_dp_mesh(), config={**_mp_plan({"head": pcp.ContextParallel()}),
                                        **_cp_plan({"head": pcp.ContextParallel()})}), ValueError, "given in both"),
    BadCall("unknown_backend", lambda: pcp.PrepareContextParallel(backend="ulysses"), ValueError, "use one of"),
    BadCall("apply_without_sep", lambda: pcp.ContextParallel().apply(Net(), _dp_mesh()), ValueError, "dims"),
    BadCall("gather_output_not_bool", lambda: pcp.ColWiseParallel(gather_output="yes"), TypeError, "gather_output"),
    BadCall("is_input_parallel_not_bool", lambda: pcp.RowWiseParallel(is_input_parallel=None),
            TypeError, "is_input_parallel"),
    BadCall("need_transpose_not_bool", lambda: pcp.SequenceParallelBegin(need_transpose=1), TypeError,
            "need_transpose"),
    BadCall("hook_not_callable", lambda: pcp.PrepareLayerInput(3), TypeError, "callable"),
    BadCall("sharding_level_4", lambda: pcp.parallelize(
        paddle.nn.Sequential(paddle.nn.Linear(8, 8)), mesh=_mp_mesh(), config={"dp_config": {"sharding_level": 4}}),
        ValueError, "sharding_level"),
    BadCall("out_dim_not_divisible", lambda: pcp.parallelize(
        paddle.nn.Sequential(paddle.nn.Linear(8, 7)), mesh=_mp_mesh(), config=_mp_plan({"0": pcp.ColWiseParallel()})),
        ValueError, "divisible"),
    BadCall("fused_qkv_without_head_counts", lambda: pcp.parallelize(
        paddle.nn.Sequential(Attention()), mesh=_mp_mesh(), config=_mp_plan({"0.qkv_proj": pcp.ColWiseParallel()})),
        ValueError, "q/k/v"),
    BadCall("tied_weight_planned_on_one_side", lambda: pcp.parallelize(
        Tied(), mesh=_mp_mesh(), config=_mp_plan({"embed": pcp.ColWiseParallel()})), ValueError, "shared with head"),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=lambda case: case.name)
def test_bad_call_is_refused_before_any_collective(case):
    with pytest.raises(case.error, match=case.message):
        case.call()


def test_no_config_returns_model_untouched():
    net = Net()
    assert pcp.parallelize(net, None, dist.ProcessMesh([0], dim_names=["sep"]), {})[0] is net
