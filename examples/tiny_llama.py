"""A small Llama written the way PaddleFormers writes it: RoPE, GQA, RMSNorm, SwiGLU,
attention through `paddle.nn.functional.scaled_dot_product_attention`.

Used by the example when PaddleFormers is not installed, and by the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import paddle
import paddle.nn as nn
import paddle.nn.functional as F


@dataclass
class TinyLlamaConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0


def rotate_half(x):
    first, second = x.chunk(2, axis=-1)
    return paddle.concat([-second, first], axis=-1)


class RMSNorm(nn.Layer):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.eps = eps

    def forward(self, x):
        return x * paddle.rsqrt(x.pow(2).mean(axis=-1, keepdim=True) + self.eps) * self.weight


class RotaryEmbedding(nn.Layer):
    def __init__(self, head_dim, theta):
        super().__init__()
        self.inv_freq = 1.0 / (theta ** (paddle.arange(0, head_dim, 2, dtype="float32") / head_dim))

    def forward(self, position_ids):
        """position_ids [b, s] -> cos, sin [b, s, 1, head_dim]."""
        angles = position_ids.astype("float32").unsqueeze(-1) * self.inv_freq
        angles = paddle.concat([angles, angles], axis=-1).unsqueeze(2)
        return angles.cos(), angles.sin()


class Attention(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        kv_size = config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias_attr=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias_attr=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias_attr=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias_attr=False)

    def forward(self, hidden, cos, sin, attention_mask=None):
        b, s = hidden.shape[:2]
        # -1 head counts: the layer keeps working when tensor parallelism splits heads.
        q = self.q_proj(hidden).reshape([b, s, -1, self.head_dim])
        k = self.k_proj(hidden).reshape([b, s, -1, self.head_dim])
        v = self.v_proj(hidden).reshape([b, s, -1, self.head_dim])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, attention_mask, is_causal=attention_mask is None)
        return self.o_proj(out.reshape([b, s, -1]))


class MLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias_attr=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias_attr=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias_attr=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        self.mlp = MLP(config)

    def forward(self, hidden, cos, sin, attention_mask=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attention_mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class TinyLlamaModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.hidden_size // config.num_attention_heads, config.rope_theta)
        self.layers = nn.LayerList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size)

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        if position_ids is None:
            position_ids = paddle.arange(input_ids.shape[1]).unsqueeze(0).expand(input_ids.shape)
        cos, sin = self.rotary(position_ids)
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, attention_mask)
        return self.norm(hidden)


class TinyLlamaForCausalLM(nn.Layer):
    """forward(input_ids, position_ids=None, labels=None, attention_mask=None) -> (loss, logits).

    Labels are already shifted; `attention_mask` ([b, 1, s, s], optional) replaces the causal mask."""

    def __init__(self, config):
        super().__init__()
        self.model = TinyLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

    def forward(self, input_ids, position_ids=None, labels=None, attention_mask=None):
        logits = self.lm_head(self.model(input_ids, position_ids=position_ids, attention_mask=attention_mask))
        loss = None if labels is None else F.cross_entropy(logits, labels.unsqueeze(-1)).mean()
        return loss, logits
