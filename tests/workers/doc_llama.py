"""The model of Paddle's `parallelize` doc example (seed), with working forward bodies.

Same layer names and shapes as the doc (fused qkv_proj and gate_up_proj, an lm_head
holding a [hidden, vocab] weight); the bodies are a plain causal Llama without RoPE.
"""
import paddle
import paddle.nn.functional as F
from paddle import nn

VOCAB, HIDDEN, INTERMEDIATE, HEADS = 32, 16, 24, 2


class LlamaRMSNorm(nn.Layer):
    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([HIDDEN], default_initializer=nn.initializer.Uniform(0.5, 1.5))

    def forward(self, x):
        return x * paddle.rsqrt(x.pow(2).mean(axis=-1, keepdim=True) + 1e-6) * self.weight


class LlamaAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        # what tensor parallel reads to split the fused projection (and sets to the local counts)
        self.num_heads = self.num_key_value_heads = HEADS
        self.head_dim = HIDDEN // HEADS
        self.qkv_proj = nn.Linear(HIDDEN, HIDDEN * 3, bias_attr=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias_attr=False)

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        q, k, v = self.qkv_proj(x).reshape([b, s, 3, self.num_heads, self.head_dim]).unbind(axis=2)  # [b, s, h, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, s, h, d]
        return self.o_proj(out.reshape([b, s, self.num_heads * self.head_dim]))


class LlamaMLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(HIDDEN, INTERMEDIATE * 2, bias_attr=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias_attr=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, axis=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.self_attn = LlamaAttention()
        self.mlp = LlamaMLP()
        self.input_layernorm = LlamaRMSNorm()
        self.post_attention_layernorm = LlamaRMSNorm()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Layer):
    def __init__(self, num_layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.LayerList([LlamaDecoderLayer() for _ in range(num_layers)])
        self.norm = LlamaRMSNorm()

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaLMHead(nn.Layer):
    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([HIDDEN, VOCAB])

    def forward(self, x):
        return paddle.matmul(x, self.weight)


class LlamaForCausalLM(nn.Layer):
    def __init__(self, num_layers=3):
        super().__init__()
        self.llama = LlamaModel(num_layers)
        self.lm_head = LlamaLMHead()

    def forward(self, input_ids):
        return self.lm_head(self.llama(input_ids))


def cross_entropy(logits, labels):
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1, 1])).mean()
