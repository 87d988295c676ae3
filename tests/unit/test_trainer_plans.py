"""paddle_cp's PaddleFormers Trainer, the parts that need no ranks: the parallel flags as degrees
(and their errors) and the plans derived from PaddleFormers models' layer names."""
import pytest

pytest.importorskip("paddleformers")

import paddle_cp as pcp  # noqa: E402
from paddle_cp.integrations.paddleformers.degrees import degrees_from_flags  # noqa: E402
from paddle_cp.integrations.paddleformers.plans import parallelize_config, tensor_parallel_plan  # noqa: E402


def test_flags_become_degrees():
    d = degrees_from_flags(8, context_parallel_size=2, sep_parallel_size=2, sharding="stage2")
    assert (d.dp, d.ring, d.ulysses, d.sep, d.backend, d.sharding_level) == (2, 2, 2, 4, "hybrid", 2)
    assert degrees_from_flags(4, sep_parallel_size=4).backend == "all2all"
    assert degrees_from_flags(4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2).dp == 1
    assert degrees_from_flags(4, sharding="stage1").sharding_level == 1
    one_dp = degrees_from_flags(2, context_parallel_size=2, sharding="stage2")
    assert (one_dp.sharding_level, one_dp.sharding_mesh_dim) == (2, None)  # over the context-parallel ranks
    dp_only = degrees_from_flags(4, context_parallel_size=2, sharding="stage1", sharding_parallel_size=2)
    assert (dp_only.sharding_level, dp_only.sharding_mesh_dim) == (1, "dp")
    none = degrees_from_flags(2, context_parallel_size=2, sharding="stage1", sharding_parallel_size=1)
    assert none.sharding_level == 0  # PaddleFormers' sharding over one rank
    assert degrees_from_flags(4, context_parallel_size=4, sharding="stage3", sharding_parallel_size=4).sharding_level
    assert degrees_from_flags(1, sharding="stage2").sharding_level == 0  # one rank: nothing to shard over


@pytest.mark.parametrize("flags, words", [
    (dict(context_parallel_size=3), "must divide the world size"),
    (dict(sharding="stage2", sharding_parallel_size=2), "set sharding_parallel_size to 8 "),
    (dict(context_parallel_size=2, sharding="stage2", sharding_parallel_size=2), "to 8 .* or 4 "),
    (dict(sharding="stage2 offload"), "offload"),
    (dict(sharding="stage4"), "stage1"),
    (dict(sequence_parallel=True), "tensor_model_parallel_size > 1"),
    (dict(pipeline_model_parallel_size=2, sharding="stage3"), "stage1"),
])
def test_bad_flags_name_the_fix(flags, words):
    with pytest.raises(ValueError, match=words):
        degrees_from_flags(8, **flags)


def _model(family, **overrides):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
    from paddleformers_models import build

    return build(family, **overrides)


def test_llama_plans():
    model = _model("llama")
    config = parallelize_config(model, degrees_from_flags(8, context_parallel_size=2, tensor_model_parallel_size=2,
                                                          sequence_parallel=True))
    cp = config["cp_config"]["parallelize_plan"]
    assert isinstance(cp[""], pcp.PrepareContextParallel) and cp[""].backend == "p2p"
    assert isinstance(cp["model.layers.*.self_attn"], pcp.ContextParallel)
    mp = config["mp_config"]["parallelize_plan"]
    kinds = {key: [type(p).__name__ for p in (v if isinstance(v, list) else [v])] for key, v in mp.items()}
    assert kinds == {
        "model.layers.*.self_attn.q_proj": ["ColWiseParallel"], "model.layers.*.self_attn.k_proj": ["ColWiseParallel"],
        "model.layers.*.self_attn.v_proj": ["ColWiseParallel"], "model.layers.*.self_attn.o_proj": ["RowWiseParallel"],
        "model.layers.*.mlp.gate_proj": ["ColWiseParallel"], "model.layers.*.mlp.up_proj": ["ColWiseParallel"],
        "model.layers.*.mlp.down_proj": ["RowWiseParallel"],
        "model.embed_tokens": ["ColWiseParallel", "SequenceParallelBegin"], "lm_head.weight": ["ColWiseParallel"],
        "model.layers.*.self_attn": ["SequenceParallelDisable"], "model.layers.*.mlp": ["SequenceParallelDisable"],
        "lm_head": ["SequenceParallelEnd"]}
    assert config["dp_config"] == {"sharding_level": 0}


@pytest.mark.parametrize("family, split", [
    ("phi3", {"model.layers.*.self_attn.qkv_proj", "model.layers.*.mlp.gate_up_proj"}),
    ("gemma3", {"model.layers.*.self_attn.qkv_proj", "model.layers.*.mlp.up_gate_proj"}),
    # MLA attention and routed experts stay whole; the dense and shared-expert MLPs are split
    ("deepseek_v3", {"model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj",
                     "model.layers.*.mlp.shared_experts.gate_proj", "model.layers.*.mlp.shared_experts.up_proj"}),
])
def test_fused_and_mla_families(family, split):
    plan = tensor_parallel_plan(_model(family), sequence_parallel=False)
    columns = {k for k, v in plan.items() if isinstance(v, pcp.ColWiseParallel) and "lm_head" not in k}
    assert columns == split


def test_pipeline_splits_the_decoder_layers_with_rotary_global():
    config = parallelize_config(_model("llama"), degrees_from_flags(4, pipeline_model_parallel_size=2),
                                micro_batches=2)
    assert config["pp_config"] == {"split_spec": "model.layers", "global_spec": "model.rotary_emb",
                                   "schedule_mode": "1F1B", "accumulate_steps": 2}


def test_paddle_cp_never_imports_paddleformers():
    import subprocess
    import sys

    code = "import sys, paddle_cp; print('paddleformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("flag, value", [("bf16", True), ("enable_auto_parallel", True),
                                         ("expert_model_parallel_size", 2), ("load_best_model_at_end", True)])
def test_fleet_only_flags_are_refused_with_the_reason(flag, value):
    from types import SimpleNamespace

    from paddle_cp.integrations.paddleformers.training_args import UNSUPPORTED, _refuse_unsupported

    _refuse_unsupported(SimpleNamespace(**{name: None for name in UNSUPPORTED}))  # defaults pass
    with pytest.raises(ValueError, match=f"{flag}={value!r} is not supported"):
        _refuse_unsupported(SimpleNamespace(**{**{name: None for name in UNSUPPORTED}, flag: value}))
