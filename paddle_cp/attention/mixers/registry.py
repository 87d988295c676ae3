"""The one list of what mixes tokens along the sequence: ContextParallel routes by it and parallelize
refuses, by it, claimed layers that no ContextParallel plan covers (api/mixer_check.py).

Looked up in order, first claim wins; mixers registered by users go before the built-in ones.
"""
from __future__ import annotations

from ... import runtime
from .base import TokenMixer


def register_mixer(mixer, first=True):
    """Add a TokenMixer instance (before the others unless `first=False`); returns it."""
    if not isinstance(mixer, TokenMixer):
        raise TypeError(f"register_mixer takes a paddle_cp TokenMixer instance, got {type(mixer).__name__}")
    mixers = runtime.installed.mixers
    if mixer not in mixers:
        mixers.insert(0 if first else len(mixers), mixer)
    return mixer


def mixer_of(layer):
    """The mixer claiming `layer`, or None for a layer that mixes no tokens along the sequence."""
    return next((mixer for mixer in runtime.installed.mixers if mixer.claims(layer)), None)


def claimed_within(layer):
    """(sublayer, mixer) for `layer` and every sublayer some mixer claims, in registration order of the model."""
    found = []
    for sub in layer.sublayers(include_self=True):
        mixer = mixer_of(sub)
        if mixer is not None:
            found.append((sub, mixer))
    return found
