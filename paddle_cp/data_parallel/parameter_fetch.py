"""Sharding level 3: a parameter's full value exists only while a layer computes with it.

Forward: a pre-hook fetches the full value of each of the layer's parameters from
its owner (a broadcast over the ranks it is sharded over); the post-hook puts the placeholders back and
frees the fetched copies, although autograd still refers to them. Backward: a
hook on the layer's output fetches them again, into the same tensors, before the
layer's gradient nodes run; once a copy's gradient is computed it is freed again.
So the copies held at any time are those of the layer in flight, not the whole
model's from forward until backward. A layer whose output is not one Tensor that
needs a gradient keeps its copies until autograd drops them: no hook would say
when backward reaches it.
"""
from __future__ import annotations

import weakref

import paddle
from paddle.autograd import PyLayer

from ..comm import collectives
from ..comm.counters import shape_nbytes
from ..params import Owned, record_of, share_record


def full_nbytes(param):
    return shape_nbytes(record_of(param).local_shape(), param.dtype)


def broadcast_full(param, tag="param_fetch"):
    """A new tensor with this rank's (tensor-parallel) value of `param`, sent by its owner."""
    record = record_of(param)
    owned = record.find(Owned)[0]
    full = param.clone() if owned.owner_here() else paddle.empty(record.local_shape(), param.dtype)
    return collectives.broadcast(owned.shard_group, full, owned.owner, tag=tag)


class _Copy:
    """One fetched full value: the tensor the layer computed with, refilled in place for backward."""

    def __init__(self, param, sharding):
        self.param, self.sharding = param, sharding
        self.tensor = FetchParameter.apply(param, sharding, weakref.ref(self))  # weak: no cycle through autograd
        sharding.gathered.add(full_nbytes(param))

    def free(self):
        if self.tensor._is_initialized():
            self.tensor._clear_data()
            self.sharding.gathered.add(-full_nbytes(self.param))

    def refill(self):
        broadcast_full(self.param)._share_buffer_to(self.tensor)
        self.sharding.gathered.add(full_nbytes(self.param))


def fetch_around(layer, members, sharding):
    """Give `layer` the full values of parameters `members`, [(holder, name)] of it or of its sublayers, for its
    forward (and backward)."""
    fetched = []  # (holder, name, _Copy), while the layer's forward runs

    def fetch(layer, inputs):
        fetched.clear()
        for holder, name in members:
            param = holder._parameters[name]
            copy = _Copy(param, sharding)
            share_record(param, copy.tensor)  # marks made on the copy (a partial gradient) reach the parameter
            copy.tensor.is_distributed = param.is_distributed  # model code reads Parameter attributes
            holder._parameters[name] = copy.tensor
            fetched.append((holder, name, copy))

    def drop(layer, inputs, output):
        copies = [copy for _, _, copy in fetched]
        for holder, name, copy in fetched:
            holder._parameters[name] = copy.param
        fetched.clear()
        if output is not None and not isinstance(output, paddle.Tensor):
            return
        for copy in copies:  # None: the forward raised, nothing will run backward through the copies
            copy.free()
        if output is not None and not output.stop_gradient:
            output.register_hook(lambda grad: _refill(copies, grad))

    # first among the pre-hooks: plans' hooks (e.g. RowWise's bias) see the full values; the
    # placeholders come back even when the forward raises (then output is None)
    layer.register_forward_pre_hook(fetch, prepend=True)
    layer.register_forward_post_hook(drop, always_call=True)


def _refill(copies, grad):
    for copy in copies:
        copy.refill()
    return grad


class FetchParameter(PyLayer):
    """The full value of a (level-3) parameter from its owner. Backward: the owner keeps
    its gradient as usual; others stash theirs for the optimizer's reduce-scatter; the
    copy, whose last use this is, is freed."""

    @staticmethod
    def forward(ctx, param, sharding, copy_ref):
        ctx.param, ctx.sharding, ctx.copy_ref = param, sharding, copy_ref
        return broadcast_full(param)

    @staticmethod
    def backward(ctx, grad):
        copy = ctx.copy_ref()
        if copy is not None:  # kept alive by the output's refill hook until backward is through the layer
            copy.free()
        if ctx.sharding.owns(ctx.param):
            return grad
        ctx.sharding.stash(ctx.param, grad)
        return paddle.zeros([0], grad.dtype)
