"""Whether a layer's model recomputes whole layers, as its model library's config says: the seam through which
OffloadRecomputeInputs checks a model before offloading what its recompute calls save (a library registers how
its config says it; PaddleFormers' rule is registered by its integration, paddle_cp/integrations/)."""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime import installed


@dataclass(frozen=True)
class RecomputeSetting:
    whole_layers: bool   # the model recomputes each whole layer in backward
    current: str         # its setting as the user wrote it, e.g. "recompute_granularity='selective'"
    turn_on: str         # the settings that make it recompute whole layers


def register_recompute_setting(rule):
    """`rule(layer)` returns the RecomputeSetting of a layer of the library's models, or None for another's."""
    if not callable(rule):
        raise TypeError(f"register_recompute_setting takes a rule layer -> RecomputeSetting | None, got {rule!r}")
    if rule not in installed.recompute_settings:
        installed.recompute_settings.append(rule)


def recompute_setting(layer):
    """The first registered rule's answer for `layer`, or None when no library's config describes it."""
    return next((setting for rule in installed.recompute_settings if (setting := rule(layer)) is not None), None)
