"""The loss of a rank whose part of the batch holds no labelled token.

Under context and data parallelism each rank's loss is the mean over its own labelled tokens. A rank may hold
none: a vision-language batch's image and video tokens carry no label, and one rank can hold nothing but a video;
a packed row's padding too, or a data-parallel rank whose samples are all prompt. Its loss layer's token mean is
then 0/0, a NaN that `loss_weight`'s weight 0 does not take out of the gradients. A library registers its loss
layer (`register_loss_layer`); on a model parallelize splits the batch of (over dp or sep ranks), each such layer
then computes, on a rank holding no labelled token (or none a mask it counts tokens by, a loss_mask, keeps), its
loss of placeholder labels times 0: a zero with zero gradients, backward still running through the whole model
(and its collectives, which the other ranks wait on). Elsewhere its labels and result are untouched, bit for bit.

Cost per call, on the device: one any() over the labels and over each mask the layer counts tokens by, a where()
over each of them, one multiply of the result; no host read.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import paddle

from .. import runtime

IGNORED_LABEL = -100


@dataclass(frozen=True)
class LossLayer:
    """A library's loss layer: `classes` (names under `package`) called with its labels as the parameter
    `labels`, and `masks`, parameters of bool masks it counts its tokens by where given (a loss_mask), each
    optional; its result a token-mean loss, or a tuple of them first; `ignored`: its attribute naming the ignored
    label; `masks_off`: its attribute that, true, has it count by its labels alone (PaddleFormers'
    use_filtered_label_loss)."""

    package: str
    classes: tuple
    labels: str = "labels"
    masks: tuple = ()
    ignored: str = "ignored_index"
    masks_off: str = ""

    def claims(self, layer):
        return type(layer).__module__.startswith(self.package) and type(layer).__name__ in self.classes


def register_loss_layer(kind):
    """Guard the loss layers of `kind` (a LossLayer) of models whose batch parallelize splits (over dp or sep
    ranks)."""
    if not isinstance(kind, LossLayer):
        raise TypeError(f"register_loss_layer takes a LossLayer, got {type(kind).__name__}")
    if kind not in runtime.installed.loss_layers:
        runtime.installed.loss_layers.append(kind)


class _Guard:
    """The hooks of one loss layer: the labels-held flag of each call in flight, innermost last."""

    def __init__(self, kind, layer):
        self.kind, self.signature, self.held = kind, inspect.signature(layer.forward), []

    def before(self, layer, args, kwargs):
        bound = self.signature.bind_partial(*args, **kwargs)
        labels = bound.arguments.get(self.kind.labels)
        if not isinstance(labels, paddle.Tensor):
            self.held.append(None)
            return None
        held = (labels != getattr(layer, self.kind.ignored, IGNORED_LABEL)).any()  # a device bool
        counting = not (self.kind.masks_off and getattr(layer, self.kind.masks_off, False))
        masks = {name: bound.arguments[name] for name in self.kind.masks
                 if counting and isinstance(bound.arguments.get(name), paddle.Tensor)}
        for mask in masks.values():  # a mask the layer counts by, all false, is a 0/0 as well
            held = held & mask.astype("bool").any()
        bound.arguments[self.kind.labels] = paddle.where(held, labels, paddle.zeros_like(labels))
        for name, mask in masks.items():
            bound.arguments[name] = paddle.where(held, mask, paddle.ones_like(mask))
        self.held.append(held)
        return bound.args, bound.kwargs

    def after(self, layer, inputs, output):
        held = self.held.pop()
        if held is None or output is None:  # no labels, or the call raised
            return None

        def scaled(value):
            if isinstance(value, paddle.Tensor) and value.dtype in (paddle.float32, paddle.float64, paddle.float16,
                                                                    paddle.bfloat16):
                return value * held.astype(value.dtype)
            return value

        return type(output)(scaled(v) for v in output) if isinstance(output, (tuple, list)) else scaled(output)


def guard_loss_layers(model):
    """Hook every registered loss layer of `model` (once per layer)."""
    for layer in model.sublayers(include_self=True):
        kind = next((kind for kind in runtime.installed.loss_layers if kind.claims(layer)), None)
        if kind is None or layer in runtime.installed.guarded_losses:
            continue
        guard = _Guard(kind, layer)
        layer.register_forward_pre_hook(guard.before, with_kwargs=True)
        layer.register_forward_post_hook(guard.after, always_call=True)
        runtime.installed.guarded_losses[layer] = guard


def guards_loss(model):
    """Whether a loss layer of `model` is guarded (a rank holding no labelled token gets a zero loss)."""
    return any(layer in runtime.installed.guarded_losses for layer in model.sublayers(include_self=True))
