"""Sequence-parallel plans: between Begin and End, activations are [s/mp, b, h], each
`mp` rank holding a slice of the sequence (norms and residual adds then do 1/mp of
the work); layers marked Disable see the whole sequence again.

Where the split begins: Paddle splits at SequenceParallelBegin's layer (the embedding).
Between it and the first decoder layer, models build their masks and positions from the
embeddings' shape (PaddleFormers' eager attention builds its causal mask there), which must
still be the whole [b, s, h]: `split_at_blocks` moves the split to the input of the blocks
holding the region's SequenceParallelDisable layers (the decoder layers), the same tensor
one step later, so the model's own code sees what it sees on one card.

A parameter used while the sequence is split only sees this rank's tokens, so its
gradient is partial over `mp`: `watch_partial_gradients` marks those parameters in
every forward (a mark is never cleared), and the optimizer sums their gradients over `mp`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import paddle

from .. import mesh as mesh_lib
from .. import runtime
from ..activations import recompute
from ..comm.autograd import gather_replicated, split_to_group
from ..params import record_of
from ..runtime import state
from .base import Plan, refuse_param_plan
from .hook_args import first_input, first_tensor, map_first_input, replace_first

def _to_split(x, group, need_transpose):
    """[b, s, h] (or [s, b, h] without transpose) -> this rank's [s/mp, b, h]."""
    _check_3d(x)
    if need_transpose:
        x = paddle.transpose(x, [1, 0, 2])
    if x.shape[0] % group.size:
        raise ValueError(
            f"sequence parallel splits the sequence over the {group.size} mp ranks, but this rank's sequence has "
            f"{x.shape[0]} tokens (after any context-parallel split): give sequences whose length (each sep rank's "
            f"share of it under context parallelism) is a multiple of {group.size} (e.g. pad them), or train "
            "without sequence_parallel")
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

    def groups_needed(self, layer, mesh):
        return (("group", "mp"),)

    def apply(self, layer, dims, param_names=()):
        self.check(layer, mesh_lib.mesh_of(dims), param_names)
        return self._register(layer, _Region(mesh_lib.dims_of(dims).mp, self.need_transpose))


@dataclass(frozen=True)
class _Region:
    """A sequence plan applied to one layer: the mp group its hooks split and gather over."""

    group: object
    need_transpose: bool

    def split_output(self, layer, inputs, output):
        state.sequence_split = True
        return replace_first(output, _to_split(first_tensor(output), self.group, self.need_transpose))

    def whole_input(self, layer, args, kwargs):
        state.sequence_split = False
        return map_first_input(args, kwargs, lambda x: _to_whole(x, self.group, self.need_transpose))

    def split_input(self, layer, args, kwargs):
        state.sequence_split = True
        return map_first_input(args, kwargs, lambda x: _to_split(x, self.group, self.need_transpose))

    def whole_output(self, layer, inputs, output):
        state.sequence_split = False
        return replace_first(output, _to_whole(first_tensor(output), self.group, self.need_transpose))


class SequenceParallelBegin(_SequencePlan):
    """On the last layer before the sequence-parallel region: its output
    [b, s, h] (or [s, b, h] with need_transpose=False) becomes [s/mp, b, h] where it
    enters the region's first block (`split_at_blocks`), or right away when the plan
    names no blocks."""

    def _register(self, layer, region):
        def begin(layer, inputs, output):
            if layer not in runtime.installed.split_at_blocks:
                return region.split_output(layer, inputs, output)
            whole = first_tensor(output)
            _check_3d(whole)
            state.pending_split = _PendingSplit(tuple(whole.shape), region.group, region.need_transpose)
            return None
        return layer.register_forward_post_hook(begin)


@dataclass(frozen=True)
class _PendingSplit:
    """A Begin's split waiting for the region's first block; `shape`: the whole tensor's."""

    shape: tuple
    group: object
    need_transpose: bool


def _split_pending(layer, args, kwargs):
    """A block's pre-hook: split its input if it is the whole tensor a Begin left pending."""
    pending = state.pending_split
    if pending is None:
        return None
    x = first_input(args, kwargs)
    if not isinstance(x, paddle.Tensor) or tuple(x.shape) != pending.shape:
        return None
    state.pending_split = None
    state.sequence_split, state.sequence_whole_shape = True, pending.shape
    return map_first_input(args, kwargs, lambda whole: _to_split(whole, pending.group, pending.need_transpose))


def _capture_pending():
    """A recomputed block replays its split: the pending split as it was at the recompute call."""
    pending = state.pending_split
    if pending is None:
        return None

    @contextlib.contextmanager
    def restore():
        saved, state.pending_split = state.pending_split, pending
        try:
            yield
        finally:
            state.pending_split = saved
    return restore


recompute.carry(_capture_pending)


class SequenceParallelEnd(_SequencePlan):
    """On the first layer after the region: its input [s/mp, b, h] becomes
    [b, s, h] (or [s, b, h] with need_transpose=False)."""

    def _register(self, layer, region):
        def end(layer, args, kwargs):
            state.sequence_whole_shape = None  # the region is over (a later model must not inherit its shape)
            return region.whole_input(layer, args, kwargs)
        return layer.register_forward_pre_hook(end, with_kwargs=True, prepend=True)


class SequenceParallelDisable(_SequencePlan):
    """A layer inside the region that needs the whole sequence (attention, or an MLP
    between column and row splits): gathered before it, split again after."""

    def _register(self, layer, region):
        layer.register_forward_pre_hook(region.whole_input, with_kwargs=True, prepend=True)
        return layer.register_forward_post_hook(region.split_output)


class SequenceParallelEnable(_SequencePlan):
    """Run one layer on the split sequence: its [b, s, h] input is split before and
    its output gathered after (Paddle warns this is slower than Begin/End)."""

    def __init__(self):
        super().__init__(need_transpose=True)

    def _register(self, layer, region):
        layer.register_forward_pre_hook(region.split_input, with_kwargs=True, prepend=True)
        return layer.register_forward_post_hook(region.whole_output)


def is_sequence_plan(plan):
    return isinstance(plan, _SequencePlan)


def watch_partial_gradients(model, dims):
    """Mark every parameter a layer uses while the sequence is split over `mp` as having a partial gradient
    there (`ParamRecord.mark_partial`: summed over mp)."""
    group = dims.mp

    def mark(layer, inputs):
        if state.sequence_split:
            for value in layer._parameters.values():
                if value is not None:  # at sharding level 3 a fetched copy, which shares the parameter's record
                    record_of(value).mark_partial(group)

    def reset(layer, inputs):
        state.sequence_split, state.pending_split, state.sequence_whole_shape = False, None, None

    model.register_forward_pre_hook(reset)
    for layer in model.sublayers(include_self=True):
        if any(p is not None for p in layer._parameters.values()):
            layer.register_forward_pre_hook(mark)


_CONTAINERS = (paddle.nn.LayerList, paddle.nn.LayerDict)  # hold blocks without being called


def split_at_blocks(model, applications):
    """Move each SequenceParallelBegin's split to the input of the region's blocks: below the
    deepest layer holding every Begin and SequenceParallelDisable layer (the decoder model), the
    outermost called layer above each Disable layer (a decoder layer). A plan whose Disable layer
    is itself such a block, or that has none, splits at the Begin layer."""
    begins = [(plan, layer) for plan, layer, _ in applications if isinstance(plan, SequenceParallelBegin)]
    disabled = [layer for plan, layer, _ in applications if isinstance(plan, SequenceParallelDisable)]
    if not begins or not disabled:
        return
    parents = {id(child): layer for layer in model.sublayers(include_self=True) for child in layer.children()}

    def lineage(layer):  # the layer, its parent, ..., the model
        chain = [layer]
        while id(chain[-1]) in parents:
            chain.append(parents[id(chain[-1])])
        return chain

    common = set.intersection(*({id(x) for x in lineage(layer)} for layer in [begin for _, begin in begins] + disabled))
    owner = next(x for x in lineage(disabled[0]) if id(x) in common)
    blocks = {}
    for layer in disabled:
        chain = lineage(layer)
        below_owner = reversed(chain[:[id(x) for x in chain].index(id(owner))])
        block = next(x for x in below_owner if not isinstance(x, _CONTAINERS))
        if block is layer:
            return
        blocks[id(block)] = block
    for _, layer in begins:
        runtime.installed.split_at_blocks[layer] = True
    recompute.install()  # a recomputed block splits its input again in backward
    for block in blocks.values():
        block.register_forward_pre_hook(_split_pending, with_kwargs=True, prepend=True)
