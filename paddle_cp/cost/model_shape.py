"""A decoder-only transformer's shape and parameter counts, from its config.json (pure, no Paddle).

Llama-like: GQA attention, SwiGLU MLP, RMSNorm; optionally Mixture-of-Experts layers
(a router, routed experts each a SwiGLU MLP `expert_intermediate` wide, shared experts
`shared_intermediate` wide in all) as Qwen3-MoE, Mixtral, gpt-oss and GLM4-MoE have them;
optionally a vision tower (`vision`, cost/vision_shape.py) before it, as a vision-language model has one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .vision_shape import VisionShape

# PaddleFormers 1.2.0's recompute_modules each family reads with recompute_granularity="selective"
# (its Llama reads none: only "full" recomputation of whole layers)
SELECTIVE_MODULES = {
    "qwen3_moe": ("core_attn", "full_attn", "mlp"),
    "glm4_moe": ("core_attn", "full_attn", "mlp"),
}
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_k")


def _first(config, keys, default=0):
    return next((config[k] for k in keys if config.get(k)), default)


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int  # the dense MLP's width (dense layers only in a MoE model)
    head_dim: int = 0  # 0: hidden // heads
    tied_embeddings: bool = False
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # all shared experts of a MoE layer together
    moe_layers: int = 0
    family: str = "llama"  # config.json's model_type
    selective_modules: tuple = field(default=(), compare=False)
    vision: VisionShape | None = None  # a vision-language model's vision tower

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} attention heads are not a multiple of {self.kv_heads} k/v heads")
        if self.experts and not (0 < self.experts_per_token <= self.experts and self.expert_intermediate
                                 and 0 < self.moe_layers <= self.layers):
            raise ValueError(f"a MoE shape needs 0 < experts_per_token <= experts ({self.experts}), "
                             "expert_intermediate and 0 < moe_layers <= layers")
        if not self.selective_modules:
            object.__setattr__(self, "selective_modules", SELECTIVE_MODULES.get(self.family, ()))

    @classmethod
    def from_config(cls, config):
        """From a PaddleFormers / Hugging Face config.json dict (dense Llama-likes and the MoE families above; a
        vision-language model's text fields at the top, as Hugging Face's Qwen2.5-VL has them, or under
        `text_config`, and its tower's under `vision_config`)."""
        family = config.get("model_type", "llama")
        vision = VisionShape.from_config(config["vision_config"], family) if config.get("vision_config") else None
        config = {**config, **(config.get("text_config") or {})}
        if config.get("kv_lora_rank") or config.get("q_lora_rank"):
            raise ValueError(f"{config.get('model_type', 'this model')} uses multi-head latent attention (MLA), "
                             "which pcp-plan does not model: give a GQA model, or the shape flags of one")
        heads = config["num_attention_heads"]
        layers = config["num_hidden_layers"]
        experts = _first(config, _EXPERTS)
        moe = {}
        if experts:
            # Mixtral and gpt-oss name the experts' width intermediate_size; the others moe_intermediate_size
            expert_width = config.get("moe_intermediate_size") or config["intermediate_size"]
            dense = set(config.get("mlp_only_layers") or ()) | set(range(config.get("first_k_dense_replace") or 0))
            step = config.get("decoder_sparse_step") or 1
            shared = (config.get("shared_expert_intermediate_size")
                      or _first(config, ("n_shared_experts", "moe_num_shared_experts")) * expert_width)
            moe = dict(experts=experts, experts_per_token=_first(config, _TOP_K), expert_intermediate=expert_width,
                       shared_intermediate=shared,
                       moe_layers=sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0))
        return cls(
            layers=layers, hidden=config["hidden_size"], heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads, vocab=config["vocab_size"],
            intermediate=config["intermediate_size"], head_dim=config.get("head_dim") or 0,
            tied_embeddings=bool(config.get("tie_word_embeddings", False)), family=family, vision=vision, **moe,
        )

    # ---- parameters, by where they live ---------------------------------------------

    @property
    def attention_params(self):
        """One layer's q, k, v, o projections."""
        return self.hidden * (2 * self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def dense_mlp_params(self):
        return 3 * self.hidden * self.intermediate

    @property
    def expert_params(self):
        """One MoE layer's routed experts (what expert parallelism divides)."""
        return self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def moe_replicated_params(self):
        """One MoE layer's router and shared experts (split like the rest of the layer, not over experts)."""
        return self.experts * self.hidden + 3 * self.hidden * self.shared_intermediate

    @property
    def dense_layers(self):
        return self.layers - self.moe_layers

    @property
    def embedding_params(self):
        return self.vocab * self.hidden

    @property
    def norm_params(self):
        return (2 * self.layers + 1) * self.hidden

    @property
    def params(self):
        embeddings = self.embedding_params * (1 if self.tied_embeddings else 2)
        return (self.layers * self.attention_params + self.dense_layers * self.dense_mlp_params
                + self.moe_layers * (self.expert_params + self.moe_replicated_params) + embeddings + self.norm_params
                + (self.vision.params if self.vision else 0))

    @property
    def active_matmul_params(self):
        """Matmul parameters one token goes through (its top-k experts, not all): 2 FLOPs each forward."""
        experts = self.experts_per_token * 3 * self.hidden * self.expert_intermediate
        moe = experts + 3 * self.hidden * self.shared_intermediate + self.experts * self.hidden
        return (self.layers * self.attention_params + self.dense_layers * self.dense_mlp_params
                + self.moe_layers * moe + self.embedding_params)  # the lm_head; the embedding is a lookup

    @property
    def largest_param(self):
        """Elements of the largest single parameter (sharding's per-parameter owners are off by at most one)."""
        return max(self.embedding_params, self.hidden * max(self.intermediate, self.expert_intermediate),
                   self.hidden * self.heads * self.head_dim, self.vision.largest_param if self.vision else 0)
