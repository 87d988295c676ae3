"""Adapters that route a model's attention calls to paddle_cp (see attention/routing.py)."""
from . import paddleformers, sdpa


def install():
    """Intercept F.scaled_dot_product_attention and, when imported, PaddleFormers' attention functions."""
    sdpa.install()
    paddleformers.install()
