"""A parallelize call that raises leaves the model exactly as it was: parameters, attributes
(head counts), hooks, records and output. Checked on PaddleFormers' Llama, one process
(every error is raised before any collective)."""
from typing import Callable, NamedTuple

import numpy as np
import paddle
import paddle.distributed as dist
import pytest
from llama_models import build_llama

import paddle_cp as pcp
from paddle_cp.params import find_record

SCALARS = (int, float, str, bool, type(None))


def _tp_plan():
    return {f"model.layers.*.self_attn.{name}": pcp.ColWiseParallel() for name in ("q_proj", "k_proj", "v_proj")} | {
        "model.layers.*.self_attn.o_proj": pcp.RowWiseParallel(),
        "model.layers.*.mlp.gate_proj": pcp.ColWiseParallel(),
        "model.layers.*.mlp.up_proj": pcp.ColWiseParallel(),
        "model.layers.*.mlp.down_proj": pcp.RowWiseParallel(),
    }


class FailingCall(NamedTuple):
    name: str
    mesh: Callable[[], dist.ProcessMesh]
    config: Callable[[], dict]
    message: str
    error: type = ValueError


FAILING_CALLS = [
    # valid tensor-parallel plans, then context-parallel plans on a mesh without sep
    FailingCall("cp_on_mesh_without_sep", lambda: dist.ProcessMesh([0, 1], dim_names=["mp"]),
                lambda: {"mp_config": {"parallelize_plan": _tp_plan()},
                         "cp_config": {"parallelize_plan": {"model.layers.*.self_attn": pcp.ContextParallel()}}},
                "dim_names"),
    # num_heads 4 divides over mp=4, num_key_value_heads 2 does not (and comes after it)
    FailingCall("kv_heads_not_divisible", lambda: dist.ProcessMesh([0, 1, 2, 3], dim_names=["mp"]),
                lambda: {"mp_config": {"parallelize_plan": _tp_plan()}}, "num_key_value_heads = 2"),
    FailingCall("tied_weight_split_on_two_axes", lambda: dist.ProcessMesh([0, 1], dim_names=["mp"]),
                lambda: {"mp_config": {"parallelize_plan": {"model.layers.0.mlp.up_proj": pcp.ColWiseParallel(),
                                                            "model.layers.1.mlp.up_proj": pcp.RowWiseParallel()}}},
                "split on different axes"),
    # valid tensor-parallel plans (applied first), then a hook factory that returns no hook
    FailingCall("hook_factory_returns_no_hook", lambda: dist.ProcessMesh([0, 1], dim_names=["mp"]),
                lambda: {"mp_config": {"parallelize_plan": _tp_plan() | {
                    "model.layers.1.mlp": pcp.PrepareLayerOutput(lambda process_mesh: None)}}},
                "must return a hook", TypeError),
]


def _snapshot(model, ids):
    layers = dict(model.named_sublayers(include_self=True))
    return {
        "params": {name: p.numpy().copy() for name, p in model.named_parameters()},
        "records": [find_record(p) for p in model.parameters()],
        "attributes": {name: {k: v for k, v in vars(layer).items() if isinstance(v, SCALARS)}
                       for name, layer in layers.items()},
        "hooks": {name: (list(layer._forward_pre_hooks), list(layer._forward_post_hooks))
                  for name, layer in layers.items()},
        "output": model(input_ids=ids)[0].numpy(),
    }


@pytest.mark.parametrize("case", FAILING_CALLS, ids=lambda case: case.name)
def test_failed_parallelize_leaves_the_model_as_it_was(case):
    pytest.importorskip("paddleformers")
    paddle.seed(3)
    model = build_llama("paddleformers")
    if case.name == "tied_weight_split_on_two_axes":
        model.model.layers[1].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    ids = paddle.randint(0, 128, [1, 12])
    before = _snapshot(model, ids)
    with pytest.raises(case.error, match=case.message):
        pcp.parallelize(model, mesh=case.mesh(), config=case.config())
    after = _snapshot(model, ids)
    assert after["attributes"] == before["attributes"]
    assert after["hooks"] == before["hooks"]
    assert after["records"] == before["records"] == [None] * len(before["records"])
    for name, value in before["params"].items():
        np.testing.assert_array_equal(after["params"][name], value, err_msg=name)
    np.testing.assert_array_equal(after["output"], before["output"])


def test_hook_factory_runs_once_at_check_and_apply_registers_its_hook():
    calls, hook = [], lambda layer, inputs: None

    def factory(process_mesh):
        calls.append(process_mesh)
        return hook

    layer, mesh = paddle.nn.Linear(2, 2), dist.ProcessMesh([0], dim_names=["mp"])
    plan = pcp.PrepareLayerInput(factory)
    plan.check(layer, mesh)
    assert calls == [mesh]  # resolved before parallelize changes anything
    plan.apply(layer, mesh)
    assert calls == [mesh]
    assert list(layer._forward_pre_hooks.values()) == [hook]
