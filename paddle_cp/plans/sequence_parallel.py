"""Sequence-parallel plans: between Begin and End, activations are [s/mp, b, h], each
`mp` rank holding a slice of the sequence (norms and residual adds then do 1/mp of
the work); layers marked Disable see the whole sequence again.

A parameter used while the sequence is split only sees this rank's tokens, so its
gradient is partial over `mp`: `watch_partial_gradients` marks those parameters in
every forward (a mark is never cleared), and the optimizer sums their gradients over `mp`.
"""
from __future__ import annotations

import paddle

from .. import mesh as mesh_lib
from ..comm.autograd import gather_replicated, split_to_group
from ..params import record_of
from ..runtime import state
from .base import Plan, refuse_param_plan
from .hook_args import first_tensor, map_first_input, replace_first

def _to_split(x, group, need_transpose):
    """[b, s, h] (or [s, b, h] without transpose) -> this rank's [s/mp, b, h]."""
    _check_3d(x)
    if need_transpose:
        x = paddle.transpose(x, [1, 0, 2])
    return split_to_group(x, group, 0)


def _to_whole(x, group, need_transpose):
    """This rank's [s/mp, b, h] -> [b, s, h] (or [s, b, h] without transpose)."""
    _check_3d(x)
    x = gather_replicated(x, group, 0)
    return paddle.transpose(x, [1, 0, 2]) if need_transpose else x


def _check_3d(x):
    if not isinstance(x, paddle.Tensor) or x.ndim != 3:
        raise ValueError(f"sequence-parallel plans work on 3-D activations [b, s, h] / [s, b, h], "
                         f"got {getattr(x, 'shape', type(x).__name__)}")


class _SequencePlan(Plan):
    """Re-lays out the sequence around a layer's other hooks: its pre-hooks go first and
    `parallelize` applies it after the layer's other plans, so its post-hooks run last
    (a tensor-parallel split of the hidden dim must not meet a split sequence)."""

    order = 2

    def __init__(self, need_transpose=True):
        if not isinstance(need_transpose, bool):
            raise TypeError(f"need_transpose must be a bool, got {type(need_transpose).__name__}")
        self.need_transpose = need_transpose

    def check(self, layer, mesh, param_names=()):
        refuse_param_plan(self, param_names)
        mesh_lib.require_dim(mesh, "mp", type(self).__name__)

    def apply(self, layer, mesh, param_names=()):
        self.check(layer, mesh, param_names)
        self._group = mesh_lib.mesh_group(mesh, ["mp"])
        return self._register(layer)

    def _split_output(self, layer, inputs, output):
        state.sequence_split = True
        return replace_first(output, _to_split(first_tensor(output), self._group, self.need_transpose))

    def _whole_input(self, layer, args, kwargs):
        state.sequence_split = False
        return map_first_input(args, kwargs, lambda x: _to_whole(x, self._group, self.need_transpose))


class SequenceParallelBegin(_SequencePlan):
    """On the last layer before the sequence-parallel region: its output
    [b, s, h] (or [s, b, h] with need_transpose=False) becomes [s/mp, b, h]."""

    def _register(self, layer):
        return layer.register_forward_post_hook(self._split_output)


class SequenceParallelEnd(_SequencePlan):
    """On the first layer after the region: its input [s/mp, b, h] becomes
    [b, s, h] (or [s, b, h] with need_transpose=False)."""

    def _register(self, layer):
        return layer.register_forward_pre_hook(self._whole_input, with_kwargs=True, prepend=True)


class SequenceParallelDisable(_SequencePlan):
    """A layer inside the region that needs the whole sequence (attention, or an MLP
    between column and row splits): gathered before it, split again after."""

    def _register(self, layer):
        layer.register_forward_pre_hook(self._whole_input, with_kwargs=True, prepend=True)
        return layer.register_forward_post_hook(self._split_output)


class SequenceParallelEnable(_SequencePlan):
    """Run one layer on the split sequence: its [b, s, h] input is split before and
    its output gathered after (Paddle warns this is slower than Begin/End)."""

    def __init__(self):
        super().__init__(need_transpose=True)

    def _register(self, layer):
        layer.register_forward_pre_hook(self._split_input, with_kwargs=True, prepend=True)
        return layer.register_forward_post_hook(self._whole_output)

    def _split_input(self, layer, args, kwargs):
        state.sequence_split = True
        return map_first_input(args, kwargs, lambda x: _to_split(x, self._group, True))

    def _whole_output(self, layer, inputs, output):
        state.sequence_split = False
        return replace_first(output, _to_whole(first_tensor(output), self._group, True))


def is_sequence_plan(plan):
    return isinstance(plan, _SequencePlan)


def watch_partial_gradients(model, mesh):
    """Mark every parameter a layer uses while the sequence is split over `mp` as having a partial gradient
    there (`ParamRecord.mark_partial`: summed over mp)."""
    group = mesh_lib.mesh_group(mesh, ["mp"])

    def mark(layer, inputs):
        if state.sequence_split:
            for value in layer._parameters.values():
                if value is not None:  # at sharding level 3 a fetched copy, which shares the parameter's record
                    record_of(value).mark_partial(group)

    def reset(layer, inputs):
        state.sequence_split = False

    model.register_forward_pre_hook(reset)
    for layer in model.sublayers(include_self=True):
        if any(p is not None for p in layer._parameters.values()):
            layer.register_forward_pre_hook(mark)
