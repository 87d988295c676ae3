"""The optimizer `parallelize` returns: reduces gradients over the replica group, then steps.

Rule: every rank takes the mean loss over its own tokens; gradients of
parameters replicated over `dp` and `sep` are averaged over those ranks. With
equal token counts per rank this reproduces one card on the global batch.
"""
from __future__ import annotations

import paddle

from .comm import collectives


def _coalesced(tensors):
    """One flat buffer per dtype: a handful of all-reduces instead of one per parameter."""
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    return by_dtype.values()


def average_gradients(parameters, mesh_group):
    if mesh_group.size == 1:
        return
    grads = [p.grad for p in parameters if p.grad is not None]
    for same_dtype in _coalesced(grads):
        flat = paddle.concat([g.reshape([-1]) for g in same_dtype])
        collectives.all_reduce(mesh_group, flat, op="grad_all_reduce")
        flat = flat / mesh_group.size
        for grad, part in zip(same_dtype, paddle.split(flat, [int(g.numel()) for g in same_dtype])):
            paddle.assign(part.reshape(grad.shape), grad)


class ParallelOptimizer:
    """Wraps a Paddle optimizer; everything but `step`/`minimize` goes to it unchanged,
    so parameter groups keep their own learning rate and weight decay."""

    def __init__(self, optimizer, replica_group):
        self._inner = optimizer
        self._replicas = replica_group

    @property
    def inner(self):
        return self._inner

    def step(self):
        average_gradients(self._inner._parameter_list, self._replicas)
        self._inner.step()

    def minimize(self, loss, startup_program=None, parameters=None, no_grad_set=None):
        loss.backward()
        self.step()

    def __getattr__(self, name):
        return getattr(self._inner, name)
