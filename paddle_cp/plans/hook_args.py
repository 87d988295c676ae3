"""The main tensor among a hooked layer's arguments and outputs, for plans that re-lay it out."""
from __future__ import annotations

import paddle


def first_input(args, kwargs):
    """The layer's main input: the first positional argument, or the first Tensor keyword argument
    (models often call `layer(hidden_states=x)`); None without one."""
    if args:
        return args[0]
    return next((value for value in kwargs.values() if isinstance(value, paddle.Tensor)), None)


def map_first_input(args, kwargs, fn):
    """(args, kwargs) with `fn` applied to the layer's main input (first_input)."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    for key, value in kwargs.items():
        if isinstance(value, paddle.Tensor):
            return args, {**kwargs, key: fn(value)}
    raise ValueError("this plan's layer was called without a Tensor input")


def first_tensor(inputs):
    return inputs[0] if isinstance(inputs, (tuple, list)) else inputs


def replace_first(inputs, value):
    if isinstance(inputs, (tuple, list)):
        return (value, *inputs[1:])
    return value
