"""No layer mixes tokens over this rank's part of the sequence only: checked at parallelize, before
any collective, the same on every rank.

When the plan splits the sequence (a PrepareContextParallel, or a ContextParallel on tensors the script
split itself), every layer the mixer registry claims
(attention/mixers/: Gated DeltaNet, Conv1D, recurrent layers, PaddleFormers attention modules, any
registered mixer) must sit under a ContextParallel plan, or be declared TokenWise; else each rank
would mix its own tokens and train silently wrong. The error names the layers and the plan key that
routes them. A layer no mixer claims (a custom attention calling SDPA) is caught when it runs: the
adapters refuse an unrouted attention call while the batch is split (attention/dispatch/routing.py).
"""
from __future__ import annotations

from ..attention.mixers import mixer_of
from ..plans.context_parallel import ContextParallel, PrepareContextParallel, TokenWise
from ..plans.vision_language import merging_rule, tower_rule
from .plan_keys import plan_key


def _covered(matched, kinds):
    """ids of the layers (and their sublayers) keyed with a plan of `kinds`."""
    return {id(sub) for _, layer, plans, _ in matched if any(isinstance(p, kinds) for p in plans)
            for sub in layer.sublayers(include_self=True)}


def _check_nesting(matched):
    planned = [(name, layer) for name, layer, plans, _ in matched if any(isinstance(p, ContextParallel) for p in plans)]
    for outer_name, outer in planned:
        inner = {id(sub) for sub in outer.sublayers()}
        for name, layer in planned:
            if id(layer) in inner:
                raise ValueError(f"ContextParallel is keyed on {outer_name!r} and on {name!r} inside it: key it on one "
                                 "of them (on the outer layer it routes every mixer inside)")


def _outside_the_split(model, matched):
    """ids of the layers that run on whole sequences: with PrepareContextParallel plans, every layer outside
    the layers they split (a vision-language model's language model: its vision tower mixes whole images)."""
    split = set()
    for _, layer, plans, _ in matched:
        if any(isinstance(p, PrepareContextParallel) for p in plans):
            rule = merging_rule(layer)
            inner = rule.language_model(layer) if rule is not None else layer
            split |= {id(sub) for sub in inner.sublayers(include_self=True)}
    if not split:  # ContextParallel on tensors the script split: the whole model
        return set()
    return {id(sub) for sub in model.sublayers(include_self=True) if id(sub) not in split}


def _check_before_the_split(matched, outside):
    """ContextParallel keyed on a layer that runs on whole sequences (before PrepareContextParallel splits them) is
    refused, but a vision tower its family's rule splits by images (plans/vision_split.py)."""
    for name, layer, plans, _ in matched:
        if id(layer) in outside and tower_rule(layer) is None and any(isinstance(p, ContextParallel) for p in plans):
            raise ValueError(
                f"ContextParallel is keyed on {name!r} ({type(layer).__name__}), which runs on the whole batch before "
                "PrepareContextParallel splits the sequence: its mixing has no split to run across. paddle_cp splits "
                "a vision tower by images only where its family's rule names the tower (pcp.VisionTower, "
                "docs/vision_language.md); drop this key (the tower then runs whole on every rank)")


def _check_towers_merged(matched):
    """A vision tower keyed with ContextParallel is split by the images of the batch its model merges: a merging
    PrepareContextParallel must key a layer above it, or the tower would run whole while the plan says split."""
    merging = {id(sub) for _, layer, plans, _ in matched
               if any(isinstance(p, PrepareContextParallel) for p in plans) and merging_rule(layer) is not None
               for sub in layer.sublayers(include_self=True)}
    for name, layer, plans, _ in matched:
        if tower_rule(layer) is not None and id(layer) not in merging and any(isinstance(p, ContextParallel)
                                                                               for p in plans):
            raise ValueError(
                f"ContextParallel is keyed on the vision tower {name!r} ({type(layer).__name__}), which paddle_cp "
                "splits by the images of the batch its model merges, but no PrepareContextParallel keys that model: "
                "key pcp.PrepareContextParallel() on the model the tower belongs to ('' for the top), or drop the "
                "tower's key (docs/vision_language.md)")


def check_mixers_routed(model, matched):
    """Raise ValueError if the plan splits the sequence and a claimed layer is not routed or declared."""
    split = [p for _, _, plans, _ in matched for p in plans if isinstance(p, (PrepareContextParallel, ContextParallel))]
    if not split:
        return
    _check_nesting(matched)
    outside = _outside_the_split(model, matched)
    _check_before_the_split(matched, outside)
    _check_towers_merged(matched)
    covered = _covered(matched, (ContextParallel, TokenWise)) | outside
    unrouted = []
    for name, layer in model.named_sublayers():
        if id(layer) in covered or any(name.startswith(outer + ".") for outer, _ in unrouted):
            continue
        mixer = mixer_of(layer)
        if mixer is not None:
            unrouted.append((name, mixer))
    if not unrouted:
        return
    listed = ", ".join(f"{name} ({mixer.name})" for name, mixer in unrouted)
    backend = split[0].backend
    routable = sorted({plan_key(name) for name, mixer in unrouted if mixer.routable})
    fixes = []
    if routable:
        fixes.append("add " + ", ".join(f"'{key}': pcp.ContextParallel({backend!r})" for key in routable)
                     + " to the plan (ContextParallel on an enclosing layer routes every mixer inside it)")
    if len(routable) < len(unrouted):
        fixes.append("the recurrent layers have no context-parallel form: train without context parallelism or "
                     "register a mixer (pcp.register_mixer)")
    fixes.append("declare a layer that does not mix tokens along the sequence with pcp.TokenWise()")
    raise ValueError(
        f"these layers mix tokens along the sequence context parallelism splits, but no ContextParallel plan "
        f"routes them, so each rank would mix only its own tokens: {listed}. Fix: {'; '.join(fixes)} "
        "(docs/hybrid_models.md)"
    )
