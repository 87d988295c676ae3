"""Model libraries paddle_cp has an integration for, found from a model's classes.

What the core needs to know about a library's models (its attention classes, MoE blocks, fused weights, weight
files) is registered by its integration module when that is imported. `parallelize`, `load_pretrained` and
`export_pretrained` import it on meeting a model built of the library's classes, so a script that never imports
the integration still gets its rules; the core itself never imports an integration by name in code.
"""
from __future__ import annotations

import importlib

# a model class's top-level package -> the integration module that registers that library's facts
INTEGRATIONS = {"paddleformers": "paddle_cp.integrations.paddleformers"}


def integrations_for(model):
    """The integration modules of the libraries `model`'s layers come from."""
    layers = model.sublayers(include_self=True) if callable(getattr(model, "sublayers", None)) else [model]
    packages = {type(layer).__module__.partition(".")[0] for layer in layers}
    return sorted(INTEGRATIONS[package] for package in packages if package in INTEGRATIONS)


def load_integrations(model):
    """Import (once: Python keeps the module) the integrations `model` needs, which register their rules."""
    for module in integrations_for(model):
        importlib.import_module(module)
