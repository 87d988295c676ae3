"""`paddle.nn.functional.scaled_dot_product_attention`, routed while a ContextParallel layer runs.

Installed while a layer a context-parallel plan was applied to lives (adapters.install) and looked up at
call time by models that call `F.scaled_dot_product_attention(...)`; calls made while no
ContextParallel layer runs go to Paddle's own function (an error while
PrepareContextParallel has split the running batch).
"""
from __future__ import annotations

import paddle.nn.functional as F

from ...runtime import installed
from ..dispatch import routing
from ..dispatch.api import call_mask


def routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, training=True, backend=None,
                scale=None, enable_gqa=True, name=None):
    plan = routing.plan_for()
    if plan is None:
        routing.refuse_unrouted("paddle.nn.functional.scaled_dot_product_attention")
        return installed.sdpa_original(query, key, value, attn_mask, dropout_p, is_causal, training, backend, scale, enable_gqa,
                         name)
    # a call with no mask attends padding keys too, as Paddle's SDPA does on one card
    return routing.attend(plan, query, key, value, call_mask(attn_mask, is_causal), dropout_p, training, scale,
                          enable_gqa, padding=attn_mask is not None)


def install():
    if installed.sdpa_original is None:
        installed.sdpa_original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = routed_sdpa


def uninstall():
    """Paddle's own function back (a script that replaced the routed one keeps its replacement)."""
    if F.scaled_dot_product_attention is routed_sdpa:
        F.scaled_dot_product_attention = installed.sdpa_original
    installed.sdpa_original = None
