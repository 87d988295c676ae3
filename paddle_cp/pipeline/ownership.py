"""Which stages hold each parameter; freeing the others.

A parameter is held by every stage whose units use it: normally one, two for tied
embeddings (first and last stage), all for a `global_spec` layer's or a container's
own parameters. Each is placed as `Held` over the rank's line of stages (params.py),
with a group over its holders: the optimizer sums its gradient there. Holders start
equal (parallelize broadcasts first), get the same summed gradient and step the same
optimizer: they stay identical without any broadcast. Only the lowest holder counts
the parameter in the global gradient norm and writes it to checkpoints.
"""
from __future__ import annotations

from ..params import hold_parameter, record_of


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


def place_on_stages(dims, held, pp_group):
    """Place every parameter as held by its stages (freeing the others'), with the group over each set of
    several holders from `dims` (a mesh.ParallelDims: pipeline_groups_needed declares them)."""
    for param, stages in held.values():
        hold_parameter(param, pp_group, stages, dims.line("pp", stages) if len(stages) > 1 else None)


def keep_own_parameters(optimizer):
    """Drop the parameters this rank does not hold from the optimizer (no state for them), groups kept."""
    def mine(params):
        return [p for p in params if record_of(p).held_here()]

    groups = optimizer._param_groups
    if groups and isinstance(groups[0], dict):
        for group in groups:
            group["params"] = mine(group["params"])
        optimizer._parameter_list = [dict(g) for g in groups]
    else:
        optimizer._parameter_list = mine(optimizer._parameter_list)
        optimizer._param_groups = optimizer._parameter_list
