"""The routed experts this rank holds, run on the rows sent to them, behind the family's own experts call.

The experts layer's class is swapped for a subclass whose forward is `HeldExperts.__call__` (its parameter
names and state dict stay the family's): the block routes as on one card, then calls its experts, which
now dispatch to their owners (dispatch.py). Listed experts run one by one, each on its rows, and, where one
card does (Qwen2/3-MoE, DeepSeek-V3), on a zero row when no token came, so the expert still gets its zero
gradient and AdamW still decays it. Stacked experts run through the family's own forward on the rows, each
row routed to one local expert with weight 1 (the router's weights are applied when the rows are back).

An owner's expert gradient sums what the P sources of its expert group sent; it is kept as their mean
(the rows' own gradients unchanged), so that averaging it over the ranks holding the same experts gives
the mean over every dp x sep rank, as the loss rule averages every other parameter's.
"""
from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from paddle.autograd import PyLayer

from .. import runtime
from .dispatch import routed_output

def _expert_parallel_class(cls):
    return runtime.installed.derived_class("expert_parallel", cls, lambda cls: type(
        f"ExpertParallel{cls.__name__}", (cls,),
        {"forward": lambda self, *args, **kwargs: self._pcp_held_experts(self, *args, **kwargs)}))


class _ScaleGradient(PyLayer):
    """Identity forward; the gradient times `factor`."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor


def _scale_gradient(x, factor):
    return x if factor == 1 else _ScaleGradient.apply(x, factor)


class HeldExperts:
    """One block's experts on this rank of its expert group."""

    def __init__(self, block, layout, group):
        self.block, self.layout, self.group = block, layout, group
        self.first, self.stop = layout.range_of(group.index)
        self._family_forward = type(block.experts).forward

    def install(self):
        experts = self.block.experts
        experts._pcp_held_experts = self
        experts.__class__ = _expert_parallel_class(type(experts))
        if self.block.kind.fallback_flag:       # the block then calls experts(hidden, indices, weights)
            setattr(self.block.layer, self.block.kind.fallback_flag, True)

    def __call__(self, experts, hidden, *args, **kwargs):
        if self.block.kind.dense_weights:       # gpt-oss: (hidden, router_indices=[T, k], routing_weights=[T, E])
            indices = kwargs.get("router_indices", args[0] if args else None)
            dense = kwargs.get("routing_weights", args[1] if len(args) > 1 else None)
            weights = paddle.take_along_axis(dense, indices, axis=1)
        else:
            indices, weights = args[:2]
        shape = hidden.shape  # [b, s, H] or [T, H]
        out = routed_output(hidden.reshape([-1, shape[-1]]), indices, weights, self.group, self.layout, self.run)
        return out.reshape(shape)  # [T, H] -> the input's shape

    def run(self, rows, counts):
        """(outputs [R, H], extra): this rank's experts on `rows` sorted by expert, counts[i] for its i-th.
        The experts' gradients are divided by the group size, the rows' are not (multiplied back)."""
        sources = self.group.size
        rows = _scale_gradient(rows, float(sources))
        outputs, extra = self._run_listed(rows, counts) if self.block.listed else (self._run_stacked(rows, counts), None)
        return _scale_gradient(outputs, 1.0 / sources), extra

    def _run_listed(self, rows, counts):
        outputs, idle, offset = [], [], 0
        runs_idle = self.block.kind.runs_idle_experts and self.block.layer.training and paddle.is_grad_enabled()
        for i, count in enumerate(counts):
            expert = self.block.experts[self.first + i]
            if count:
                outputs.append(expert(rows[offset:offset + int(count)]))
                offset += int(count)
            elif runs_idle:
                idle.append((expert(paddle.zeros([1, rows.shape[-1]], rows.dtype)) * 0.0).sum())
        # no row here: the (empty) rows themselves, so the return all-to-all stays in the graph
        return (paddle.concat(outputs) if outputs else rows), (paddle.add_n(idle) if idle else None)

    def _run_stacked(self, rows, counts):
        if rows.shape[0] == 0:
            return rows
        local = np.repeat(np.arange(self.stop - self.first), counts)  # the stacked tensors hold experts first..stop
        index = paddle.to_tensor(local[:, None].astype("int64"))                      # [R, 1]
        experts = self.block.experts
        if self.block.kind.dense_weights:
            one_hot = F.one_hot(index[:, 0], self.stop - self.first).astype(rows.dtype)                 # [R, held]
            out = self._family_forward(experts, rows, router_indices=index, routing_weights=one_hot)
        else:
            out = self._family_forward(experts, rows, index, paddle.ones([rows.shape[0], 1], rows.dtype))
        return out.reshape([-1, rows.shape[-1]])  # the family's output -> [R, H]
