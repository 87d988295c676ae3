"""Tiny PaddleFormers models of each family, built from configs with their defaults (eager attention).

DeepSeek-V3 and the Qwen *Deprecated classes import two GPU-fleet modules pip
cannot install; they are stubbed here (a test helper, never the package).
"""
import functools
import sys
import types
from dataclasses import dataclass

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, fuse_rms_norm=False)  # the fused norm has no CPU kernel
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
FAMILIES = ("llama", "gemma3", "gpt_oss", "deepseek_v3", "phi3", "qwen3", "qwen2", "qwen2_moe", "qwen3_moe",
            "ernie4_5", "glm4_moe", "qwen3_next")
WINDOW = 5


def stub_gpu_modules():
    provider = types.ModuleType("paddleformers.transformers.gpt_provider")

    @dataclass
    class GPTModelProvider:
        transform_rules = {}

    provider.GPTModelProvider = GPTModelProvider
    sys.modules.setdefault(provider.__name__, provider)
    ops = types.ModuleType("paddlefleet_ops")
    ops.is_deep_ep_available = lambda: False
    sys.modules.setdefault(ops.__name__, ops)


def build(family, **overrides):
    """A tiny model of `family`; what each one exercises is in the comment next to it."""
    stub_gpu_modules()
    import paddleformers.transformers as pf

    sizes = {**SIZES, **overrides}
    if family == "llama":  # the default config
        return pf.LlamaForCausalLM(pf.LlamaConfig(**sizes))
    if family == "gemma3":  # sliding + full layers, query_pre_attn_scalar != head_dim
        return pf.Gemma3ForCausalLM(pf.Gemma3TextConfig(
            **sizes, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL))
    if family == "gpt_oss":  # attention sinks, sliding + full layers, MoE
        return pf.GptOssForCausalLM(pf.GptOssConfig(
            **sizes, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL))
    if family == "deepseek_v3":  # MLA (q/k head dim 24, v head dim 16), YaRN, MoE
        return pf.DeepseekV3ForCausalLM(pf.DeepseekV3Config(
            **{**sizes, "num_key_value_heads": 4}, head_dim=8, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc",
            scoring_func="sigmoid", norm_topk_prob=True,
            rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=64, beta_fast=32.0,
                              beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)))
    if family == "phi3":  # fused qkv, the window passed as a keyword to the attention function
        return pf.Phi3ForCausalLM(pf.Phi3Config(**sizes, sliding_window=WINDOW))
    if family == "qwen3":  # through its *Deprecated class (the default class needs paddlefleet), q/k norms
        from paddleformers.transformers.qwen3.modeling import Qwen3ForCausalLMDeprecated

        return Qwen3ForCausalLMDeprecated(pf.Qwen3Config(**sizes, head_dim=16))
    if family == "qwen2":  # fused qkv with biases
        from paddleformers.transformers.qwen2.modeling import Qwen2ForCausalLMDeprecated

        return Qwen2ForCausalLMDeprecated(pf.Qwen2Config(**sizes))
    if family == "qwen2_moe":  # MoE with a gated shared expert
        from paddleformers.transformers.qwen2_moe.modeling import Qwen2MoeForCausalLMDeprecated

        return Qwen2MoeForCausalLMDeprecated(pf.Qwen2MoeConfig(
            **sizes, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32))
    if family == "qwen3_moe":  # listed routed experts (6, top-2), through its *Deprecated class
        from paddleformers.transformers.qwen3_moe.modeling import Qwen3MoeForCausalLMDeprecated

        return Qwen3MoeForCausalLMDeprecated(pf.Qwen3MoeConfig(
            **sizes, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True))
    if family == "ernie4_5":  # fused qkv, tied embeddings
        return pf.Ernie4_5ForCausalLM(pf.Ernie4_5Config(**sizes))
    if family == "glm4_moe":  # partial RoPE, sigmoid-routed MoE after a dense first layer, tied embeddings
        from paddleformers.transformers.glm4_moe.modeling import Glm4MoeForCausalLMDeprecated

        return Glm4MoeForCausalLMDeprecated(pf.Glm4MoeConfig(
            **sizes, head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1))
    if family == "qwen3_next":  # 3 Gated DeltaNet layers + 1 full attention; 2 q/k heads repeated to 6 v heads
        return pf.Qwen3NextForCausalLM(pf.Qwen3NextConfig(
            **{**SIZES, "num_hidden_layers": 4, **overrides}, head_dim=16, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=6, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32))
    raise ValueError(f"unknown family {family!r}: use one of {FAMILIES}")


def rechunked(model, chunk_size=8):
    """`model` with every Gated DeltaNet rule chunked by `chunk_size` instead of its 64: the same arithmetic in
    another order, a second fp32 evaluation as valid as the default one (each is one sample of the model's
    rounding noise; one card's distance from the float64 truth, paddle_cp/api/float64_truth.py, is the larger
    of the two)."""
    for layer in model.sublayers():
        if callable(getattr(layer, "chunk_gated_delta_rule", None)):
            layer.chunk_gated_delta_rule = functools.partial(layer.chunk_gated_delta_rule, chunk_size=chunk_size)
    return model
