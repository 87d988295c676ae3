"""The model of Paddle's `PrepareContextParallel` doc example (seed), with working forward bodies.

Same layer names and call structure as the doc (LlamaForCausalLayer -> llama -> attention -> sdpa, the
top layer's forward taking (input, label)); sizes made consistent and small (the doc's q has one
64-wide head against ten k/v heads); q/k/v reshaped to [b, s, heads, head_dim] for SDPA, causal.
"""
import paddle
from paddle import nn

HIDDEN, HEADS, VOCAB = 16, 2, 32


class SDPALayer(nn.Layer):
    def forward(self, q, k, v):
        return paddle.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, s, h, d]


class AttentionLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.hidden_size = HIDDEN
        self.num_key_value_heads = HEADS
        self.head_dim = HIDDEN // HEADS
        self.sdpa = SDPALayer()
        self.q = nn.Linear(HIDDEN, HIDDEN, bias_attr=False)
        self.k = nn.Linear(HIDDEN, HEADS * self.head_dim, bias_attr=False)
        self.v = nn.Linear(HIDDEN, HEADS * self.head_dim, bias_attr=False)

    def forward(self, input):
        b, s = input.shape[0], input.shape[1]
        q, k, v = (proj(input).reshape([b, s, HEADS, self.head_dim]) for proj in (self.q, self.k, self.v))
        return self.sdpa(q, k, v).reshape([b, s, HIDDEN])


class LlamaLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.attention = AttentionLayer()

    def forward(self, input, label):
        return self.attention(input)


class LlamaForCausalLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.llama = LlamaLayer()
        self.weight = self.create_parameter(shape=[HIDDEN, VOCAB])
        self.loss_func = nn.CrossEntropyLoss()

    def forward(self, input, label):
        out = self.llama(input, label)
        logits = paddle.matmul(out, self.weight)
        self.loss_func(logits, label)  # as the doc: computed, and the logits returned
        return logits
