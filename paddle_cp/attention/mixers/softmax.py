"""Softmax attention: ring, Ulysses or both (attention/api.py), reached through the adapters.

The attention calls made under a ContextParallel layer (Paddle's SDPA, and the attention functions a model
library's integration registers as an adapter: attention/adapters/) are routed to paddle_cp
(attention/routing.py). Every ContextParallel layer gets this mixer (a custom layer calling SDPA is recognised
only when it calls it); the layers it claims are the attention modules a model library registers
(`register_attention_class`; PaddleFormers' in paddle_cp/integrations/), which parallelize refuses outside a plan.
"""
from __future__ import annotations

from .. import adapters, routing
from .base import TokenMixer

_ATTENTION_CLASSES = []  # predicates on a layer's class: is it a softmax-attention module of a model library


def register_attention_class(predicate):
    """Claim as softmax attention every layer whose class `predicate(cls)` accepts."""
    if not callable(predicate):
        raise TypeError(f"register_attention_class takes a predicate on a class, got {predicate!r}")
    if predicate not in _ATTENTION_CLASSES:
        _ATTENTION_CLASSES.append(predicate)


class SoftmaxAttention(TokenMixer):
    name = "softmax attention"

    def claims(self, layer):
        return any(predicate(type(layer)) for predicate in _ATTENTION_CLASSES)

    def _route(self, layer, plan):
        adapters.install(layer)
        routing.cover(plan, layer)
