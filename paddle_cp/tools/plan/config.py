"""What runs a planned layout: paddle_cp.parallelize's config (YAML-able, for paddle_cp.load_config) and the
PaddleFormers config fields it needs (recomputation, chunked loss, the attention kernel, fused kernels) and the
TrainingArguments that turn its memory savers on. Pure, no Paddle.

Plan keys are those of PaddleFormers' decoder models (`<prefix>.layers.<i>.self_attn.q_proj`, ...; see
integrations/paddleformers/plans.py, which derives the same plans from a built model).
"""
from __future__ import annotations

from ...cost.memory import fuses
from ...cost.candidate import RECOMPUTE_FULL, SHARD_DIMS


def parallelize_config(layout, model_prefix="model"):
    """The config (see paddle_cp.api.config.load_config) that runs `layout`."""
    dims = [(name, size) for name, size in (("pp", layout.pp), ("dp", layout.dp), ("sep", layout.cp), ("mp", layout.tp))
            if size > 1] or [("dp", 1)]
    config = {"mesh": {"shape": [s for _, s in dims], "dim_names": [n for n, _ in dims]},
              "dp_config": _dp_config(layout)}
    layers = f"{model_prefix}.layers.*"
    if layout.pp > 1:  # PaddleFormers computes its rotary tables before the layer loop
        config["pp_config"] = {"split_spec": f"{model_prefix}.layers", "global_spec": f"{model_prefix}.rotary_emb",
                               "schedule_mode": "VPP" if layout.vpp > 1 else "1F1B", "accumulate_steps": layout.micro}
        if layout.vpp > 1:
            config["pp_config"]["vpp_degree"] = layout.vpp
    if layout.tp > 1:
        config["mp_config"] = {"parallelize_plan": _tensor_sequence_plan(model_prefix, layers)}
    if layout.cp > 1:
        args = {"backend": layout.backend}
        if layout.backend == "hybrid":
            args["ulysses_degree"] = layout.ulysses
        config["cp_config"] = {"parallelize_plan": {
            "": {"PrepareContextParallel": dict(args)},  # the model itself: splits input_ids and labels
            f"{layers}.self_attn": [{"ContextParallel": dict(args)}],
        }}
    memory_plans = {}
    if layout.mlp_tile:
        memory_plans[f"{layers}.mlp"] = [{"SequenceTiled": {"tokens": layout.mlp_tile}}]
    if layout.offload:
        memory_plans[layers] = "OffloadRecomputeInputs"
    if memory_plans:
        config.setdefault("cp_config", {"parallelize_plan": {}})["parallelize_plan"].update(memory_plans)
    if layout.ep > 1:  # ep_config: the MoE block of every layer, experts folded onto dp x sep
        config["ep_config"] = {"degree": layout.ep, "parallelize_plan": {f"{layers}.mlp": "ExpertParallel"}}
    return config


def _dp_config(layout):
    dp_config = {"sharding_level": layout.sharding}
    if layout.offload_optimizer:
        dp_config["offload_optimizer"] = True
    replica_dims = [d for d, size in (("dp", layout.dp), ("sep", layout.cp)) if size > 1]
    chosen = [d for d in replica_dims if d in layout.shard_dims]
    if layout.sharding and chosen != [d for d in replica_dims if d in SHARD_DIMS]:  # only when narrower
        dp_config["sharding_mesh_dim"] = chosen[0] if len(chosen) == 1 else chosen
    return dp_config


def _tensor_sequence_plan(prefix, layers):
    """Megatron's split (q/k/v and gate/up by columns, o and down by rows), the embedding and lm_head split too,
    and the sequence split over mp between the embedding and lm_head (sequence parallelism)."""
    plan = {f"{prefix}.embed_tokens": ["ColWiseParallel", "SequenceParallelBegin"]}
    plan.update({f"{layers}.self_attn.{p}_proj": "ColWiseParallel" for p in "qkv"})
    plan[f"{layers}.self_attn.o_proj"] = "RowWiseParallel"
    plan.update({f"{layers}.mlp.{p}_proj": "ColWiseParallel" for p in ("gate", "up")})
    plan[f"{layers}.mlp.down_proj"] = "RowWiseParallel"
    plan[f"{layers}.self_attn"] = "SequenceParallelDisable"
    plan[f"{layers}.mlp"] = {"SequenceParallelDisable": {"need_transpose": False}}
    plan["lm_head"] = "SequenceParallelEnd"
    plan["lm_head.weight"] = "ColWiseParallel"
    return plan


def model_config(layout):
    """PaddleFormers config fields the layout assumes (set them before building the model): its
    recomputation and chunked loss, and on GPU flash attention where no ContextParallel replaces the
    model's own (`gpu_attention_fields`)."""
    fields = {}
    if layout.recompute == RECOMPUTE_FULL:
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif layout.selective:
        fields.update(recompute_granularity="selective", recompute_modules=list(layout.selective))
    if layout.loss_chunk:
        fields.update(use_fused_head_and_loss_fn=True, loss_subbatch_sequence_length=layout.loss_chunk)
    return fields


def kernel_fields(fused):
    """PaddleFormers config fields that make its Llama call the fused GPU kernels the estimate counts (`fused`:
    cost/memory.py's FUSED_KERNELS' names): fuse_rms_norm (1.2.0's RMSNorm reads it, on by default; the CPU has
    no such kernel). Its Llama has no field for a fused RoPE: `rotary_note` says so."""
    return {"fuse_rms_norm": True} if fuses(fused, "rms_norm") else {}


def rotary_note(fused):
    """What a user must know when the estimate assumes a fused RoPE (None otherwise)."""
    if not fuses(fused, "rope"):
        return None
    return ("the estimate assumes a fused rotary kernel: PaddleFormers 1.2.0's Llama has no config field for one "
            "(its apply_rotary_pos_emb rotates q and k in fp32 with eager ops), so its peak is higher than this")


def trainer_arguments(layout):
    """paddle_cp's TrainingArguments (PaddleFormers' Trainer) that turn on the layout's memory savers."""
    fields = {}
    if layout.offload:
        fields["offload_recompute_inputs"] = True
    if layout.mlp_tile:
        fields["mlp_tile_tokens"] = layout.mlp_tile
    if layout.offload_optimizer:  # PaddleFormers' own flag, mapped onto dp_config offload_optimizer
        fields["tensorwise_offload_optimizer"] = True
    return fields


def gpu_attention_fields(layout):
    """Without ContextParallel the model's own attention runs: flash, which keeps no [s, s] scores."""
    return {"_attn_implementation": "flashmask"} if layout.cp == 1 else {}
