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


def test_sequence_parallel_after_context_parallel_splits_batches_in_equal_chunks():
    """Tensor parallelism's sequence split divides each ring rank's share over mp. The documents layout shares this
    packed 2048-token row 1067 / 981 over 2 ring ranks (what stopped pcp-train at its 8th step on the example YAML
    with tensor 2 + sequence parallel x ring 2); the plan derived with sequence parallel splits it in 2N equal
    chunks, 1024 each, as pcp-plan's configs with tensor parallelism do. Without sequence parallel: documents."""
    import numpy as np

    from paddle_cp.attention.layout.sequence_layout import SequenceLayout
    from paddle_cp.attention.masks.block_mask import Documents
    from paddle_cp.integrations.paddleformers.plans import DecoderNames, context_parallel_plan_spec

    row = Documents.from_position_ids(np.concatenate([np.arange(n) for n in (392, 164, 280, 381, 267, 339, 225)])[None])
    shares = {}
    for flags in (dict(tensor_model_parallel_size=2, sequence_parallel=True), {}):
        config = parallelize_config(_model("llama"), degrees_from_flags(4 if flags else 2, context_parallel_size=2,
                                                                         **flags))
        split = config["cp_config"]["parallelize_plan"][""].layout
        shares[split] = SequenceLayout("p2p", 2).for_batch(row, split).lengths(2048)
    assert shares == {"chunks": [1024, 1024], "documents": [1067, 981]}
    planned = context_parallel_plan_spec(DecoderNames.standard(), "p2p", sequence_parallel_mp=2)
    assert planned[""] == {"PrepareContextParallel": {"backend": "p2p", "layout": "chunks"}}


def test_the_log_names_the_layout_built():
    from paddle_cp.integrations.paddleformers.plans import layout_summary

    degrees = degrees_from_flags(8, context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True,
                                 sharding="stage1")
    config = parallelize_config(_model("llama"), degrees)
    assert layout_summary(degrees.mesh(), config) == (
        "paddle_cp: mesh dp 2 x sep 2 x mp 2: context parallel ring (p2p), batches in the chunks layout, "
        "tensor parallel + sequence parallel, sharding level 1")


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


def _qwen3_next():
    """Three Gated DeltaNet layers (`linear_attn`), then one softmax attention (`self_attn`); MoE MLPs."""
    from workers.paddleformers_models import SIZES, stub_gpu_modules

    stub_gpu_modules()
    import paddleformers.transformers as pf

    return pf.Qwen3NextForCausalLM(pf.Qwen3NextConfig(
        **{**SIZES, "num_hidden_layers": 4}, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32))


def _kinds(plan):
    return {key: [type(p).__name__ for p in (v if isinstance(v, list) else [v])] for key, v in plan.items()}


def test_qwen3_next_plans_route_both_mixers():
    """ContextParallel on the attention and on the linear attention; tensor parallel splits the attention
    (q|gate grouped by k/v head with k and v: whole groups per rank) and the shared expert, never the
    linear attention or the routed experts; sequence parallel gives both mixers the whole sequence."""
    model = _qwen3_next()
    config = parallelize_config(model, degrees_from_flags(8, context_parallel_size=2, tensor_model_parallel_size=2,
                                                          sequence_parallel=True))
    cp = config["cp_config"]["parallelize_plan"]
    assert _kinds(cp) == {"": ["PrepareContextParallel"], "model.layers.*.self_attn": ["ContextParallel"],
                          "model.layers.*.linear_attn": ["ContextParallel"]}
    assert _kinds(config["mp_config"]["parallelize_plan"]) == {
        "model.layers.*.self_attn.qkv_proj": ["ColWiseParallel"], "model.layers.*.self_attn.o_proj": ["RowWiseParallel"],
        "model.layers.*.mlp.shared_expert.up_gate_proj": ["ColWiseParallel"],
        "model.layers.*.mlp.shared_expert.down_proj": ["RowWiseParallel"],
        "model.embed_tokens": ["ColWiseParallel", "SequenceParallelBegin"], "lm_head.weight": ["ColWiseParallel"],
        "model.layers.*.self_attn": ["SequenceParallelDisable"], "model.layers.*.linear_attn": ["SequenceParallelDisable"],
        "model.layers.*.mlp": ["SequenceParallelDisable"], "lm_head": ["SequenceParallelEnd"]}


def test_ernie_plans():
    config = parallelize_config(_model("ernie4_5"), degrees_from_flags(4, sep_parallel_size=2,
                                                                       tensor_model_parallel_size=2))
    assert _kinds(config["cp_config"]["parallelize_plan"]) == {
        "": ["PrepareContextParallel"], "model.layers.*.self_attn": ["ContextParallel"]}
    assert {k for k, v in _kinds(config["mp_config"]["parallelize_plan"]).items() if v == ["ColWiseParallel"]} == {
        "model.layers.*.self_attn.qkv_proj", "model.layers.*.mlp.up_gate_proj", "model.embed_tokens", "lm_head.weight"}


def test_attention_with_per_head_parameters_stays_whole():
    """gpt-oss's sinks are one parameter per head: its attention is not split, and with its routed experts
    whole too there is nothing to split."""
    with pytest.raises(ValueError, match="no q/k/v/o or gate/up/down projections to split"):
        tensor_parallel_plan(_model("gpt_oss"), sequence_parallel=False)


@pytest.mark.parametrize("family, parts", [("phi3", (64, 32, 32)), ("qwen2", None), ("gemma3", None),
                                           ("ernie4_5", None)])
def test_fused_qkv_split_by_the_layout_the_model_declares(family, parts):
    """Phi3 fuses q | k | v (split per part); Qwen2, Gemma3 and ERNIE group the columns by k/v head
    (PaddleFormers' `fused_qkv` in _gen_aoa_config), which a plain split keeps whole per rank; the
    q/k norms of a split attention (Gemma3) get their gradients summed over mp."""
    import paddle.distributed as dist

    from paddle_cp.params import Partial, find_record
    from paddle_cp.plans.column_info import column_info

    model = _model(family)
    pcp.parallelize(model, None, dist.ProcessMesh([0], dim_names=["mp"]),
                    {"mp_config": {"parallelize_plan": tensor_parallel_plan(model, sequence_parallel=False)}})
    attention = model.model.layers[0].self_attn
    assert column_info(attention.qkv_proj).parts == parts
    norms = [p for n, p in model.named_parameters() if n.startswith("model.layers.0.self_attn.") and "norm" in n]
    summed = [any(p.reduce == "sum" for p in find_record(norm).find(Partial)) for norm in norms]
    assert summed == [True] * (2 if family == "gemma3" else 0)


def test_pipeline_splits_the_decoder_layers_with_rotary_global():
    config = parallelize_config(_model("llama"), degrees_from_flags(4, pipeline_model_parallel_size=2),
                                micro_batches=2)
    assert config["pp_config"] == {"split_spec": "model.layers", "global_spec": "model.rotary_emb",
                                   "schedule_mode": "1F1B", "accumulate_steps": 2}


def test_expert_parallel_flags_become_ep_config():
    degrees = degrees_from_flags(4, context_parallel_size=2, use_expert_parallel=True, expert_model_parallel_size=4)
    assert (degrees.dp, degrees.sep, degrees.ep) == (2, 2, 4)  # folded onto dp x sep: no ranks of its own
    config = parallelize_config(_model("qwen3_moe"), degrees)
    assert config["ep_config"]["degree"] == 4
    assert [(k, type(v).__name__) for k, v in config["ep_config"]["parallelize_plan"].items()] == [
        ("model.layers.*.mlp", "ExpertParallel")]
    assert "ep_config" not in parallelize_config(_model("qwen3_moe"), degrees_from_flags(4, context_parallel_size=2))


def test_paddle_cp_never_imports_paddleformers():
    import subprocess
    import sys

    code = "import sys, paddle_cp; print('paddleformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("flag, value", [("distributed_dataloader", True), ("enable_auto_parallel", True),
                                         ("to_static", True), ("load_best_model_at_end", True)])
def test_fleet_only_flags_are_refused_with_the_reason(flag, value):
    from types import SimpleNamespace

    from paddle_cp.integrations.paddleformers.training_args import UNSUPPORTED, _refuse_unsupported

    _refuse_unsupported(SimpleNamespace(**{name: None for name in UNSUPPORTED}))  # defaults pass
    with pytest.raises(ValueError, match=f"{flag}={value!r} is not supported"):
        _refuse_unsupported(SimpleNamespace(**{**{name: None for name in UNSUPPORTED}, flag: value}))


def test_a_share_without_labels_gives_a_zero_loss_and_zero_gradients():
    """PaddleFormers' criterion, guarded as parallelize guards it (sequence/empty_share.py): its token mean over no
    label is 0/0 (NaN, in the gradients too); guarded it is a zero that still depends on the logits: backward runs
    through the model, grads exactly 0; with labels its own loss bit for bit. (Under Ulysses 4 in
    tests/multiproc/test_paddleformers_cli.py.)"""
    import numpy as np
    import paddle

    from paddle_cp import libraries
    from paddle_cp.sequence.empty_share import guard_loss_layers, guards_loss

    model = _model("llama")
    ids = paddle.randint(0, 128, [1, 8])
    no_labels = paddle.full([1, 8], -100, dtype="int64")
    assert np.isnan(float(model(input_ids=ids, labels=no_labels)[0]))
    own = float(model(input_ids=ids, labels=ids)[0])
    libraries.load_integrations(model)
    guard_loss_layers(model)
    assert guards_loss(model)
    loss = model(input_ids=ids, labels=no_labels)[0]
    loss.backward()
    assert float(loss) == 0.0
    grads = [p.grad.numpy() for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(model.parameters()) and all((g == 0).all() for g in grads)
    model.clear_gradients()
    assert float(model(input_ids=ids, labels=ids)[0]) == own


def test_the_loss_weight_counts_the_tokens_the_criterion_counts():
    """By the labels, or by a loss_mask the model's criterion divides by (PaddleFormers' sft loss, unless
    use_filtered_label_loss): one card's denominator, which loss_weight sums over the ranks."""
    import paddle

    from paddle_cp.integrations.paddleformers.loss import local_tokens

    labels = paddle.to_tensor([[1, -100, 2, 3, -100, 4]])
    mask = paddle.to_tensor([[True, True, False, False, False, True]])
    assert local_tokens(labels, None, -100) == 4
    assert local_tokens(labels, None, -100, mask=mask) == 3
