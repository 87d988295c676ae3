"""Conv1D over the split sequence: each run this rank holds, widened by the tokens its kernel reaches
before and after it (attention/algorithms/sequence_windows.py), convolved by the layer's own forward.

A Conv1D's output j reads inputs j - left .. j - left + span - 1 (span = dilation (kernel - 1) + 1,
`left` its zero padding before the sequence). Under context parallelism this rank's output for the
token at global position t is one card's output t: the output aligned with its input, as Gated
DeltaNet's causal conv (padding kernel - 1, the caller keeping the first s outputs) and 'same' convs
use it. So each run needs `left` tokens before it and span - 1 - left after it (0 for a causal conv).
The pre-hook hands the layer the runs' windows side by side; the layer pads and convolves them
(each window's outputs read only its own tokens); the post-hook keeps each run's outputs and returns
[b, C, s_local] (or [b, s_local, C]): a caller slicing `[:, :, :s]` gets them unchanged. Stride 1,
zero padding and an output at least as long as the input are required (else a ValueError).
"""
from __future__ import annotations

from typing import NamedTuple

import paddle
from paddle.nn.functional.conv import _update_padding_nd

from ..dispatch import routing
from ..algorithms.sequence_windows import run_windows
from .base import TokenMixer

SEQUENCE_AXIS = {"NCL": 2, "NLC": 1}


class SequenceGeometry(NamedTuple):
    axis: int    # the sequence axis of the input and output
    left: int    # the layer's zero padding before the sequence: the tokens an output needs before its own
    after: int   # and after it


def sequence_geometry(layer):
    """The layer's SequenceGeometry; a ValueError naming the fix when it cannot run over a split sequence."""
    where = f"Conv1D {layer.full_name()} over the context-parallel sequence"
    if layer._data_format not in SEQUENCE_AXIS:
        raise ValueError(f"{where}: data_format {layer._data_format!r} is not supported: use 'NCL' or 'NLC'")
    if layer._padding_mode != "zeros":
        raise ValueError(f"{where}: padding_mode={layer._padding_mode!r} is not supported: use padding_mode='zeros'")
    if layer._stride[0] != 1:
        raise ValueError(f"{where}: stride {layer._stride[0]} is not supported (each token's output must stay on "
                         "its rank): use stride 1")
    kernel, dilation = layer._kernel_size[0], layer._dilation[0]
    span = dilation * (kernel - 1) + 1
    padding, algorithm = _update_padding_nd(layer._padding, layer._data_format == "NLC", 1)
    if algorithm == "SAME":
        if dilation != 1:
            raise ValueError(f"{where}: padding='same' with dilation {dilation} (Paddle then drops the dilation): "
                             "give the padding as numbers")
        left, right = (kernel - 1) // 2, kernel - 1 - (kernel - 1) // 2
    else:
        left, right = (padding[0], padding[0]) if len(padding) == 1 else padding
    if left + right < span - 1:
        raise ValueError(f"{where}: padding ({left}, {right}) gives fewer outputs than inputs, so outputs are not "
                         f"aligned with tokens: pad by {span - 1} in all (e.g. padding={span - 1} and keep the first "
                         "s outputs for a causal conv)")
    return SequenceGeometry(SEQUENCE_AXIS[layer._data_format], left, max(0, span - 1 - left))


def windows_for(plan, local_len, before, after):
    """The RunWindows of this rank for the batch `plan` runs (its length agreed if no batch is published)."""
    batch = routing.sequence(plan, local_len)
    return run_windows(batch.layout, batch.seq_len, batch.groups.sep.index, before, after)


class Conv1DOverSequence(TokenMixer):
    name = "Conv1D over the sequence"

    def claims(self, layer):
        return isinstance(layer, paddle.nn.Conv1D)

    def check(self, layer, layout):
        sequence_geometry(layer)

    def _route(self, layer, plan):
        geometry = sequence_geometry(layer)
        axis = geometry.axis
        pending = []  # windows of calls between the pre- and post-hook (innermost last)

        def widen(x):
            if x.ndim != 3:
                raise ValueError(f"Conv1D {layer.full_name()} under ContextParallel takes [b, C, L] or [b, L, C] "
                                 f"inputs, got {x.ndim}-D")
            windows = windows_for(plan, x.shape[axis], geometry.left, geometry.after)
            pending.append(windows)
            return windows.widen(x, axis, plan.groups.sep)  # [b, C, s_local] -> [b, C, windows]

        def before(layer, args, kwargs):
            if routing.paused():
                return None
            if args:
                return (widen(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "x": widen(kwargs["x"])}

        def after(layer, inputs, output):
            if routing.paused():
                return None
            routing.mark_ran()
            return pending.pop().narrow(output, axis)  # [b, C, windows'] -> [b, C, s_local]

        layer.register_forward_pre_hook(before, with_kwargs=True)
        layer.register_forward_post_hook(after)
