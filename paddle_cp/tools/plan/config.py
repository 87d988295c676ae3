"""What runs a planned layout: paddle_cp.parallelize's config (YAML-able, for paddle_cp.load_config) and the
PaddleFormers config fields it needs (recomputation, chunked loss, the attention kernel, fused kernels) and the
TrainingArguments that turn its memory savers on.

The plans are written by the integration's writer of decoder-model plans (integrations/zoo.py's
`decoder_plans`, the one the Trainer derives its plans with), from the layer names every PaddleFormers decoder
model shares (`<prefix>.layers.<i>.self_attn.q_proj`, ...).
"""
from __future__ import annotations

from ...integrations.zoo import decoder_plans, decoder_recompute
from ...cost.memory import fuses
from ...cost.candidate import RECOMPUTE_FULL, SHARD_DIMS


# where PaddleFormers 1.2.0 puts each vision-language family's vision tower (ContextParallel on it splits it)
VISION_TOWERS = {"qwen2_5_vl": "model.visual"}


def parallelize_config(layout, model_prefix="model", vision_tower=None):
    """The config (see paddle_cp.api.config.load_config) that runs `layout`; `vision_tower`: a vision-language
    model's tower to split over the sep ranks by images (plans/vision_split.py), its name in the model."""
    names = decoder_plans.DecoderNames.standard(model_prefix)
    dims = [(name, size) for name, size in (("pp", layout.pp), ("dp", layout.dp), ("sep", layout.cp), ("mp", layout.tp))
            if size > 1] or [("dp", 1)]
    config = {"mesh": {"shape": [s for _, s in dims], "dim_names": [n for n, _ in dims]},
              "dp_config": _dp_config(layout)}
    if layout.pp > 1:
        config["pp_config"] = decoder_plans.pipeline_config(names, "VPP" if layout.vpp > 1 else "1F1B", layout.micro,
                                                            vpp_degree=layout.vpp if layout.vpp > 1 else None)
    if layout.tp > 1:  # Megatron's split and the sequence split over mp between the embedding and lm_head
        config["mp_config"] = {"parallelize_plan": decoder_plans.tensor_parallel_plan_spec(names, True)}
    if layout.cp > 1:
        config["cp_config"] = {"parallelize_plan": decoder_plans.context_parallel_plan_spec(
            names, layout.backend, layout.ulysses, sequence_parallel_mp=layout.tp)}
        if vision_tower:
            degree = {"ulysses_degree": layout.ulysses} if layout.backend == "hybrid" else {}
            config["cp_config"]["parallelize_plan"][vision_tower] = {
                "ContextParallel": {"backend": layout.backend, **degree}}
    memory_plans = decoder_plans.memory_plan_spec(names, layout.offload, layout.mlp_tile)
    if memory_plans:
        config.setdefault("cp_config", {"parallelize_plan": {}})["parallelize_plan"].update(memory_plans)
    if layout.ep > 1:  # the MoE block of every layer, experts folded onto dp x sep
        config["ep_config"] = decoder_plans.expert_config(names, layout.ep)
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


def model_config(layout):
    """PaddleFormers config fields the layout assumes (set them before building the model): its
    recomputation and chunked loss, and on GPU flash attention where no ContextParallel replaces the
    model's own (`gpu_attention_fields`)."""
    fields = {}
    if layout.recompute == RECOMPUTE_FULL:
        fields.update(decoder_recompute.FULL)
    elif layout.selective:
        fields.update(decoder_recompute.selective(layout.selective))
    if layout.loss_chunk:
        fields.update(use_fused_head_and_loss_fn=True, loss_subbatch_sequence_length=layout.loss_chunk)
    return fields


def vision_fields(layout):
    """A vision-language model's vision_config fields the layout assumes: its tower recomputed block by block under
    full recomputation, as the estimate counts it (the tower reads its own config's recompute fields)."""
    return {"vision_config": dict(decoder_recompute.FULL)} if layout.recompute == RECOMPUTE_FULL else {}


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
