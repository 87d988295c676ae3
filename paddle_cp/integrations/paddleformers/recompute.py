"""PaddleFormers' recomputation settings (activations/recompute_settings.py's seam): a model recomputes whole
decoder layers with `recompute_granularity="full"` in its config; the Trainer's and pcp-plan's recomputation
fields are written here."""
from __future__ import annotations

from paddle_cp import RecomputeSetting

# the config fields that recompute each decoder layer whole, one layer per recompute call
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
TURN_ON = ", ".join(f"{field}={value!r}" for field, value in FULL.items())


def recompute_setting(layer):
    """The setting of a layer whose model's config carries PaddleFormers' `recompute_granularity`, else None."""
    config = getattr(layer, "config", None)
    if config is None or not hasattr(config, "recompute_granularity"):
        return None
    granularity = config.recompute_granularity
    return RecomputeSetting(granularity == "full", f"recompute_granularity={granularity!r}", TURN_ON)


def selective(modules):
    """The config fields that recompute only `modules` of each layer (PaddleFormers' recompute_modules)."""
    return dict(recompute_granularity="selective", recompute_modules=list(modules))
