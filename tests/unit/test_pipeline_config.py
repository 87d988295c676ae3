"""pp_config errors, each naming the fix, raised before any collective (one process: any
communication would fail here, so reaching the error proves none was attempted)."""
import paddle
import paddle.distributed as dist
import pytest

import paddle_cp as pcp
from paddle_cp.pipeline.runner import Pipeline
from paddle_cp.pipeline.settings import check_settings
from paddle_cp.pipeline.stages import build_stage_plan
from workers.doc_llama import LlamaForCausalLM, cross_entropy

PP2 = dist.ProcessMesh([0, 1], dim_names=["pp"])


def parallelize(pp_config, mesh=PP2, layers=3):
    model = LlamaForCausalLM(num_layers=layers)
    return pcp.parallelize(model, None, mesh, {"pp_config": pp_config})


@pytest.mark.parametrize("pp_config,match", [
    ({"split_spec": "llama.layers", "micro_batches": 2}, "unknown keys.*micro_batches"),
    ({"split_spec": "llama.blocks"}, "matches no layer.*llama.layers"),
    ({"split_spec": {"llama.layers.9": pcp.SplitPoint.END}}, "unknown layers"),
    ({"split_spec": {"llama.layers.0": pcp.SplitPoint.END, "llama.layers.1": pcp.SplitPoint.END}}, "exactly 1"),
    ({"split_spec": {"llama.embed_tokens": pcp.SplitPoint.BEGINNING}}, "without layers.*move the split points"),
    ({"split_spec": {"lm_head": pcp.SplitPoint.END}}, "without layers"),
    ({"split_spec": "llama.layers", "vpp_degree": 2, "schedule_mode": "VPP"}, "vpp_degree=2 must divide"),
    ({"split_spec": "llama.layers", "schedule_mode": "VPP"}, "vpp_degree >= 2"),
    ({"split_spec": "llama.layers", "schedule_mode": "ZBH1"}, "use one of"),
    ({"split_spec": "llama.layers", "accumulate_steps": 0}, "positive int"),
    ({"split_spec": "llama.layers", "loss_fn": "ce"}, "callable"),
    ({"split_spec": "llama.layers", "global_spec": "llama.rotary"}, "global_spec names unknown"),
    ({"global_spec": "llama.norm"}, "needs split_spec"),
])
def test_bad_pp_config_names_the_fix(pp_config, match):
    with pytest.raises((ValueError, TypeError), match=match):
        parallelize(pp_config)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="cannot fill 4 pipeline stages"):
        parallelize({"split_spec": "llama.layers"}, dist.ProcessMesh([0, 1, 2, 3], dim_names=["pp"]))


def test_a_mesh_without_pp_is_refused():
    with pytest.raises(ValueError, match="mesh dim named 'pp'"):
        parallelize({"split_spec": "llama.layers"}, dist.ProcessMesh([0, 1], dim_names=["dp"]))


def test_paddle_split_rules():
    """The prefix form gives the first L % p stages one more layer; BEGINNING starts a stage."""
    model = LlamaForCausalLM(num_layers=3)
    plan = build_stage_plan(model, "llama.layers", None, 2, 1)
    stages = {name: v for name, _, v in plan.units}
    assert stages == {"llama.embed_tokens": 0, "llama.layers.0": 0, "llama.layers.1": 0, "llama.layers.2": 1,
                      "llama.norm": 1, "lm_head": 1}
    begin = build_stage_plan(model, {"llama.layers.1": pcp.SplitPoint.BEGINNING}, "llama.norm", 2, 1)
    assert {n: v for n, _, v in begin.units} == {"llama.embed_tokens": 0, "llama.layers.0": 0, "llama.layers.1": 1,
                                                "llama.layers.2": 1, "llama.norm": None, "lm_head": 1}
    vpp = build_stage_plan(LlamaForCausalLM(num_layers=4), "llama.layers", None, 2, 2)
    assert [v for n, _, v in vpp.units if n.startswith("llama.layers")] == [0, 1, 2, 3]


def _pipeline(pp_config, stage=0):
    """A pipeline installed without its groups: forward errors must come before any transfer."""
    model = LlamaForCausalLM(num_layers=4)
    settings = check_settings(pp_config)
    plan = build_stage_plan(model, settings.split_spec, None, 2, settings.vpp_degree)
    Pipeline(model, plan, settings, stage, peers={}, pp_group=None)
    return model


def test_micro_batches_must_divide_the_batch():
    model = _pipeline({"split_spec": "llama.layers", "accumulate_steps": 2, "loss_fn": cross_entropy})
    ids = paddle.zeros([3, 8], "int64")
    with pytest.raises(ValueError, match="accumulate_steps=2 must divide the batch size 3"):
        model(ids, labels=ids)


@pytest.mark.parametrize("pp_config", [{"split_spec": "llama.layers", "accumulate_steps": 2},
                                       {"split_spec": "llama.layers", "schedule_mode": "VPP", "vpp_degree": 2}])
def test_schedules_need_a_loss(pp_config):
    model = _pipeline(pp_config)
    with pytest.raises(ValueError, match="labels=labels.*loss_fn"):
        model(paddle.zeros([4, 8], "int64"))


def test_scaling_the_returned_loss_is_recorded_for_the_optimizer():
    """model(...) ran every backward already: a scaled returned loss (a script's loss / k, a GradScaler) records
    its factor for the optimizer's step, on the device (no host read), less a scale the schedule applied
    already (a GradScaler's); the calls of one step must agree on it: a difference is flagged on the device,
    for the step's agreement (LossFactorAgreement) to raise, one step later, on every rank."""
    from paddle_cp import runtime
    from paddle_cp.pipeline.runner import _LossAfterBackward
    anchor = paddle.zeros([], "float32")
    anchor.stop_gradient = False
    try:
        _LossAfterBackward.apply(anchor, paddle.to_tensor(2.5), None).backward()  # the plain loop
        assert float(runtime.state.pipeline_loss_scale) == 1.0
        runtime.state.pipeline_loss_scale = None
        (_LossAfterBackward.apply(anchor, paddle.to_tensor(2.5), None) * 0.5).backward()
        assert float(runtime.state.pipeline_loss_scale) == 0.5 and runtime.state.pipeline_loss_scales_differ is None
        (_LossAfterBackward.apply(anchor, paddle.to_tensor(2.5), None) * 0.5).backward()
        assert not bool(runtime.state.pipeline_loss_scales_differ)
        (_LossAfterBackward.apply(anchor, paddle.to_tensor(2.5), None) * 0.25).backward()
        assert bool(runtime.state.pipeline_loss_scales_differ)
        runtime.state.pipeline_loss_scale = runtime.state.pipeline_loss_scales_differ = None
        # a GradScaler's scale, which the schedule applied before its backwards already: factor 1
        (_LossAfterBackward.apply(anchor, paddle.to_tensor(2.5), paddle.to_tensor([1024.0])) * 1024).backward()
        assert float(runtime.state.pipeline_loss_scale) == 1.0
    finally:
        runtime.reset()


def test_loss_factors_that_differed_within_a_step_raise_at_the_next_agreement():
    """The step's flag and factor are gathered on the device; the next step's agreement reads them and raises."""
    import paddle.distributed as dist

    from paddle_cp import mesh as mesh_lib
    from paddle_cp import runtime
    from paddle_cp.pipeline import LossFactorAgreement
    agreement = LossFactorAgreement(mesh_lib.MeshGroup((0,), 0, None), dist.ProcessMesh([0], dim_names=["pp"]))
    try:
        agreement.agree(paddle.to_tensor(0.5))
        agreement.agree(1.0)  # the first step's factors agreed
        runtime.state.pipeline_loss_scales_differ = paddle.to_tensor(True)
        agreement.agree(paddle.to_tensor(0.5))  # this step's calls differed: known at the next agreement
        with pytest.raises(ValueError, match=r"on ranks \[0\] the model\(...\) losses of one step were scaled"):
            agreement.agree(1.0)
    finally:
        runtime.reset()
