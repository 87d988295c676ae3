"""Which stages hold each parameter; freeing the others; the gradients of parameters held by
several stages (tied input/output embeddings, global layers) summed between them.

A parameter is held by every stage whose units use it: normally one, two for tied
embeddings (first and last stage), all for a `global_spec` layer's or a container's
own parameters. Holders start equal (parallelize broadcasts first), get the same
summed gradient and step the same optimizer: they stay identical without any
broadcast. Only the lowest holder counts the parameter in the global gradient norm.
"""
from __future__ import annotations

import math

import paddle

from .. import mesh as mesh_lib
from ..comm import collectives
from ..params import is_lazy, record_of


def holders(model, plan):
    """{id(param): (param, sorted stage positions holding it)}."""
    held = {}
    for _, layer, virtual in plan.units:
        stages = range(plan.stages) if virtual is None else [plan.rank_of(virtual)]
        for p in layer.parameters():
            held.setdefault(id(p), (p, set()))[1].update(stages)
    for p in model.parameters():  # owned by a container directly: used wherever its code runs
        held.setdefault(id(p), (p, set(range(plan.stages))))
    return {k: (p, tuple(sorted(s))) for k, (p, s) in held.items()}


def release_foreign(held, stage, pp_group):
    """Free the parameters this stage does not hold; tag every parameter with where it lives."""
    for param, stages in held.values():
        record = record_of(param)
        record.stage, record.pp_stages, record.pp_group = stages[0], stages, pp_group
        if stage not in stages and not is_lazy(param):  # a lazy one has no data; cleared, it would lose its place
            param._clear_data()


def keep_own_parameters(optimizer):
    """Drop other stages' parameters from the optimizer (no state for them), groups kept."""
    def mine(params):  # release_foreign tagged every parameter of the model with its stages
        return [p for p in params if record_of(p).on_this_stage()]

    groups = optimizer._param_groups
    if groups and isinstance(groups[0], dict):
        for group in groups:
            group["params"] = mine(group["params"])
        optimizer._parameter_list = [dict(g) for g in groups]
    else:
        optimizer._parameter_list = mine(optimizer._parameter_list)
        optimizer._param_groups = optimizer._parameter_list


class SharedGradients:
    """Sums the gradients of parameters held by several stages over exactly those stages."""

    def __init__(self, mesh, held, stage):
        sets = sorted({stages for _, stages in held.values() if len(stages) > 1})
        groups = mesh_lib.line_subgroups(mesh, "pp", sets)  # every rank, same order
        self._work = [(groups[s], [p for p, st in held.values() if st == s]) for s in sets if stage in s]

    def reduce(self):
        for group, params in self._work:
            grads = [p.grad if p.grad is not None else paddle.zeros(p.shape, p.dtype) for p in params]
            flat = paddle.concat([g.reshape([-1]) for g in grads])
            collectives.all_reduce(group, flat, tag="pp_shared_grad_all_reduce")
            for p, part in zip(params, paddle.split(flat, [math.prod(g.shape) for g in grads])):
                if p.grad is None:
                    p.grad = part.reshape(p.shape)
                else:
                    paddle.assign(part.reshape(p.shape), p.grad)


def stage_value(tensor, record, local):
    """A parameter's local value on every rank: broadcast from its first holder over `pp`."""
    group = record.pp_group
    if group is None:
        return local
    buffer = local if group.index == record.stage else paddle.empty(local.shape, local.dtype)
    return collectives.broadcast(group, buffer, record.stage, tag="state_dict")
