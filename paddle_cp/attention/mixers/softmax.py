"""Softmax attention: ring, Ulysses or both (attention/dispatch/api.py), reached through the adapters.

The attention calls made under a ContextParallel layer (Paddle's SDPA, and the attention functions a model
library's integration registers as an adapter: attention/adapters/) are routed to paddle_cp
(attention/dispatch/routing.py). Every ContextParallel layer gets this mixer (a custom layer calling SDPA is recognised
only when it calls it); the layers it claims are the attention modules a model library registers
(`register_attention_class`; PaddleFormers' in paddle_cp/integrations/), which parallelize refuses outside a plan.
"""
from __future__ import annotations

from ... import runtime
from .. import adapters
from ..dispatch import routing
from .base import TokenMixer


def register_attention_class(predicate):
    """Claim as softmax attention every layer whose class `predicate(cls)` accepts."""
    if not callable(predicate):
        raise TypeError(f"register_attention_class takes a predicate on a class, got {predicate!r}")
    predicates = runtime.installed.attention_classes  # is it a softmax-attention module of a model library
    if predicate not in predicates:
        predicates.append(predicate)


class SoftmaxAttention(TokenMixer):
    name = "softmax attention"

    def claims(self, layer):
        return any(predicate(type(layer)) for predicate in runtime.installed.attention_classes)

    def _route(self, layer, plan):
        adapters.install(layer)
        routing.cover(plan, layer)
