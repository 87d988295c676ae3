"""Adapters that route a model's attention calls to paddle_cp (see attention/dispatch/routing.py)."""
from ... import runtime
from . import paddleformers, sdpa


def install(holder):
    """Intercept F.scaled_dot_product_attention and, when imported, PaddleFormers' attention functions while
    `holder` (a layer a context-parallel plan was applied to) lives: undone once the last one is released."""
    runtime.installed.hold_patch("sdpa", holder, sdpa.install, sdpa.uninstall)
    runtime.installed.hold_patch("paddleformers_attention", holder, paddleformers.install, paddleformers.uninstall)
