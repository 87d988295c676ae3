"""One module per PaddleFormers model family that needs facts of its own (its MoE block, ...): each has a
`register()`, called when the integration is imported. A new family is one file here; families with nothing of
their own (Llama, Qwen3, Gemma3, Phi3, ERNIE 4.5, Qwen3-Next...) need none: models.py's rules read their layers."""
from __future__ import annotations

import importlib
import pkgutil


def register_all():
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}").register()
