"""Softmax attention: ring, Ulysses or both (attention/api.py), reached through the adapters.

The attention calls made under a ContextParallel layer (Paddle's SDPA, PaddleFormers'
ALL_ATTENTION_FUNCTIONS) are routed to paddle_cp (attention/routing.py). Every ContextParallel layer
gets this mixer (a custom layer calling SDPA is recognised only when it calls it); the layers it
claims are PaddleFormers' attention modules, which parallelize refuses outside a plan.
"""
from __future__ import annotations

from .. import adapters, routing
from .base import TokenMixer


class SoftmaxAttention(TokenMixer):
    name = "softmax attention"

    def claims(self, layer):
        kind = type(layer)
        return kind.__module__.startswith("paddleformers.") and kind.__name__.endswith("Attention")

    def _route(self, layer, plan):
        adapters.install(layer)
        routing.cover(plan, layer)
