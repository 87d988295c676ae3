"""Token mixers: what ContextParallel routes, picked by what the layer is (registry.py).

Built in: Gated DeltaNet (linear attention), Conv1D over the sequence, recurrent layers (refused),
softmax attention. Adding a mixer is one file with a TokenMixer subclass and its registration here
(or `paddle_cp.register_mixer(...)` from user code).
"""
from ... import runtime
from .base import TokenMixer  # noqa: F401
from .conv1d import Conv1DOverSequence
from .gated_delta import GatedDeltaNet
from .recurrent import Recurrent
from .registry import claimed_within, mixer_of, register_mixer  # noqa: F401
from .softmax import SoftmaxAttention, register_attention_class  # noqa: F401

for _mixer in (GatedDeltaNet(), Conv1DOverSequence(), Recurrent(), SoftmaxAttention()):
    register_mixer(_mixer, first=False)
del _mixer  # the instances live in runtime.installed.mixers


def check(layer, layout):
    """Every mixer under a ContextParallel layer can run in `layout` (raises before any collective)."""
    for sub, mixer in claimed_within(layer):
        mixer.check(sub, layout)


def route(layer, plan):
    """Route `layer`'s token mixing under `plan`: attention calls made anywhere under it, and every
    sublayer a mixer claims."""
    next(m for m in runtime.installed.mixers if type(m) is SoftmaxAttention).attach(layer, plan)
    for sub, mixer in claimed_within(layer):
        mixer.attach(sub, plan)
