"""`parallelize(model, optimizer, mesh, config)`: apply the parallelisms in order.

Order: every plan and every value derived from the whole plan (local head
counts, fused parts, shared weights, mesh dims) is checked before anything
changes, so a call that raises leaves the model as it was and no rank waits in
a collective; parameters are made identical on all ranks (a lazily built model's
are left uninitialized: lazy_init.py); tensor and sequence
plans (mp_config) with the context-parallel plans (cp_config) merged in after
them are applied; then the pipeline (pp_config); every parameter's placements are
completed over the mesh; then data parallel (dp_config): sharding over the
replicas and the optimizer that reduces gradients.

Paddle's two steps are the same path cut in two: `parallelize_model` does all of
the model's part (sharding levels shard the model's parameters, which the optimizer
built afterwards from `model.parameters()` holds) and leaves its state on each
parameter; `parallelize_optimizer` finds it there and wraps the optimizer.
`parallelize(model, optimizer, ...)` is the two calls.
"""
from __future__ import annotations

import math
import weakref

from dataclasses import dataclass
from typing import Optional

from .. import libraries, mesh as mesh_lib
from ..comm import collectives
from ..activations import recompute
from ..pipeline import (LossFactorAgreement, apply_pipeline, keep_own_parameters, pipeline_groups_needed, plan_pipeline,
                        recompute_boundary)
from ..data_parallel.buckets import bucket_size_mb, plan_buckets
from ..data_parallel.host_optimizer import HostOptimizer, check_offloadable, offload_requested
from ..data_parallel.optimizer import ParallelOptimizer, optimizer_parameters
from ..params import castable_placeholders, complete_placements, is_lazy, placement_groups_needed, record_of
from .expert_config import expert_applications
from .lazy_init import defer_initialization, require_initialized
from .mixer_check import check_mixers_routed
from .plan_annotation import annotate_plan
from .parameter_plans import implied_lora_plans
from .plan_keys import resolve_plan
from ..plans.context_parallel import PrepareContextParallel, check_backends_agree
from ..plans.sequence_parallel import is_sequence_plan, split_at_blocks, watch_partial_gradients
from ..plans.sharded_inputs import require_sharded_inputs, require_split_labels
from ..sequence.empty_share import guard_loss_layers
from ..data_parallel.sharding import Sharding, check_level, shard_parameters, sharding_dims, sharding_groups_needed

CONFIG_KEYS = ("dp_config", "mp_config", "pp_config", "cp_config", "ep_config")
_STATE_ATTR = "_pcp_parallelized"


def _listed(plans):
    return list(plans) if isinstance(plans, (list, tuple)) else [plans]


def _concatenated(name, mp_plans, cp_plans):
    mp_plans, cp_plans = _listed(mp_plans), _listed(cp_plans)
    twice = {type(p).__name__ for p in mp_plans} & {type(p).__name__ for p in cp_plans}
    if twice:
        raise ValueError(f"plan key {name!r} is given in both mp_config and cp_config with {sorted(twice)}: "
                         "give each plan once")
    return [*mp_plans, *cp_plans]


def _merged_plan(config):
    """mp plans then cp plans, without touching the user's dicts (Paddle mutates them).

    A key in both gets both, mp's first. Paddle `.update()`s mp's plan with cp's, so
    cp's replaces mp's: the sequence-parallel Llama plan's `SequenceParallelDisable`
    on the attention layer that also gets `ContextParallel` would be dropped and the
    attention would see the wrong layout.
    """
    plan = {}
    for key in ("mp_config", "cp_config"):
        section = config.get(key) or {}
        if not isinstance(section, dict):
            raise TypeError(f"{key} must be a dict like {{'parallelize_plan': {{...}}}}, got {type(section).__name__}")
        unknown = set(section) - {"parallelize_plan"}
        if unknown:
            raise ValueError(f"{key} has unknown keys {sorted(unknown)}: it takes only 'parallelize_plan'")
        for name, plans in (section.get("parallelize_plan") or {}).items():
            if name in plan:
                plans = _concatenated(name, plan[name], plans)
            plan[name] = plans
    return plan


def _check_config(config):
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown parallelize config keys {sorted(unknown)}: use {list(CONFIG_KEYS)}")
    return check_level(config.get("dp_config"))


def broadcast_parameters(model, mesh_group):
    """Start every rank from the first one's full parameters, as one card would (before any split).
    Lazy ones are left alone: every rank draws the same values when they are initialized."""
    for param in model.parameters():
        if not is_lazy(param):
            collectives.broadcast(mesh_group, param, 0, tag="param_broadcast")


def _parallel_dims(mesh, applications, annotation=None, pipeline_needs=(), sharding_needs=()):
    """The mesh's ParallelDims with every group this run uses made now, in one sorted order on every rank
    (new_group is collective): the whole mesh's, what the plans declare (Plan.groups_needed), the plan
    annotation's, the pipeline's and sharding's, and what placement completion needs; the plans read them
    from it."""
    needs = [("group", "world"), *placement_groups_needed(mesh), *pipeline_needs, *sharding_needs]
    needs += annotation.groups_needed() if annotation is not None else ()
    needs += [need for plan, layer, _ in applications for need in plan.groups_needed(layer, mesh)]
    return mesh_lib.dims_of(mesh).build(needs)


def _validated_plan(model, config, mesh):
    """(applications in order, annotation) for the merged plan; raises, changing nothing, if any part cannot work."""
    matched = resolve_plan(model, _merged_plan(config))
    matched += implied_lora_plans(matched)
    annotation = annotate_plan(model, matched, mesh)
    for _, layer, plans, params in matched:
        for plan in plans:
            plan.check(layer, mesh, params)
    check_backends_agree([plan for _, _, plans, _ in matched for plan in plans])
    check_mixers_routed(model, matched)  # after each plan's own checks: a plan that cannot apply says why first
    applications = [(plan, layer, params) for _, layer, plans, params in matched for plan in plans]
    applications.sort(key=lambda item: item[0].order)  # stable; see Plan.order
    return applications, annotation


def parallelize(model, optimizer=None, mesh=None, config=None):
    """Parallelize `model` (in place) and wrap `optimizer`; returns (model, optimizer).
    The same as `parallelize_model` then `parallelize_optimizer`."""
    if optimizer is not None:
        _check_optimizer(optimizer, config or {})  # before parallelize_model's collectives
    model = parallelize_model(model, mesh, config)
    if optimizer is not None:
        optimizer = parallelize_optimizer(optimizer, mesh, config)
    return model, optimizer


@dataclass(frozen=True)
class _Parallelized:
    """What `parallelize_model` leaves for `parallelize_optimizer` (on each of the model's parameters)."""

    mesh: object
    level: int
    dims: tuple  # the dims sharding spans
    world: object  # MeshGroup of the whole mesh
    sharding: Optional[Sharding]
    # (PrepareContextParallel, a weak reference to its layer) of each one applied: check_parity (weak: the
    # parameters carrying this must not keep the model, and the patches it holds, alive)
    prepare: tuple = ()
    loss_factor: object = None  # a pipeline's LossFactorAgreement: the optimizer checks a returned loss's factor
    # the gradient buckets, those only step() reduces (plan_buckets), and the size they were cut to
    buckets: tuple = ((), frozenset(), math.inf)


def parallelize_model(model, mesh=None, config=None):
    """Parallelize `model` in place (Paddle's first step); build the optimizer from its parameters after."""
    config = dict(config or {})
    level = _check_config(config)
    libraries.load_integrations(model)  # its library's attention classes, MoE blocks and fused weights
    if mesh is not None:
        mesh_lib.set_mesh(mesh)
    if not any(config.get(key) for key in CONFIG_KEYS):
        return model
    mesh = mesh_lib.resolve_mesh(mesh)
    pipeline = plan_pipeline(model, mesh, config["pp_config"]) if config.get("pp_config") else None
    applications, annotation = _validated_plan(model, config, mesh)
    experts = expert_applications(model, config, mesh)
    applications += experts  # after mp's plans: tensor parallel inside experts first
    # nothing has changed so far; from here on every rank runs the same collectives
    sharded_over = sharding_dims(config.get("dp_config"))
    pipeline_needs = pipeline_groups_needed(model, pipeline[1]) if pipeline else ()
    dims = _parallel_dims(mesh, applications, annotation, pipeline_needs,
                          sharding_groups_needed(level, mesh, sharded_over))
    world = dims.world
    lazy = defer_initialization(model, world)
    broadcast_parameters(model, world)
    annotation.apply(dims)
    for plan, layer, params in applications:
        plan.apply(layer, dims, params)
    if any(is_sequence_plan(plan) for plan, _, _ in applications):
        watch_partial_gradients(model, dims)
        split_at_blocks(model, applications)
    loss_factor = None
    if pipeline:
        apply_pipeline(model, dims, *pipeline)  # keeps this stage's only
        recompute.install()  # recompute calls around stage boundaries ask the running stage
        recompute.around_calls(recompute_boundary)
        loss_factor = LossFactorAgreement(world, mesh, experts_span_dp=bool(experts))
    else:
        require_sharded_inputs(model, dims, applications)  # ContextParallel without PrepareContextParallel
        require_split_labels(model, dims, applications)  # PrepareContextParallel on an inner layer only
    for param in model.parameters():
        complete_placements(param, dims)
    held = [p for p in model.parameters() if record_of(p).held_here()]
    sharding = shard_parameters(level, held, dims, sharded_over)
    # a pipeline reduces in step() (optimizer.py), in one bucket: its stages hold different parameters, and cut
    # by size, a tied weight would fall in a different bucket on each stage that sums it
    size_mb = math.inf if pipeline else bucket_size_mb(config.get("dp_config"))
    buckets = (*plan_buckets(model, held, size_mb), size_mb)
    if sharding is not None and level == 3:
        sharding.release_parameters(model)
    if lazy:
        require_initialized(model)
    castable_placeholders(model)
    prepare = tuple((plan, weakref.ref(layer)) for plan, layer, _ in applications
                    if isinstance(plan, PrepareContextParallel))
    if mesh_lib.dim_size(mesh, "dp") * mesh_lib.dim_size(mesh, "sep") > 1:
        guard_loss_layers(model)  # a rank may hold no labelled token: its loss layers give a zero, not 0/0
    state = _Parallelized(mesh, level, sharded_over, world, sharding, prepare, loss_factor, buckets)
    for param in model.parameters():
        setattr(param, _STATE_ATTR, state)
    return model


def parallelize_optimizer(optimizer, mesh=None, config=None):
    """Wrap an optimizer built from a `parallelize_model`-ed model's parameters (Paddle's second step)."""
    config = dict(config or {})
    level = _check_config(config)
    if not any(config.get(key) for key in CONFIG_KEYS):
        return optimizer
    state = _model_state(optimizer_parameters(optimizer))
    if mesh is not None and not mesh_lib.same_mesh(mesh, state.mesh):
        raise ValueError("parallelize_optimizer got another mesh than parallelize_model: pass the same one, or none")
    dims = sharding_dims(config.get("dp_config"))
    if (level, dims) != (state.level, state.dims):
        differs = (f"sharding_level {level} differs from the {state.level}" if level != state.level else
                   f"sharding_mesh_dim {list(dims)} differs from the {list(state.dims)}")
        raise ValueError(f"dp_config {differs} parallelize_model got: pass both calls the same config")
    _check_optimizer(optimizer, config)
    if not all(record_of(p).held_here() for p in optimizer_parameters(optimizer)):
        keep_own_parameters(optimizer)  # a pipeline: the optimizer keeps this stage's parameters
    host = HostOptimizer(optimizer) if offload_requested(config.get("dp_config")) else None
    return ParallelOptimizer(optimizer, state.world, state.sharding, state.loss_factor, state.buckets, host)


def _check_optimizer(optimizer, config):
    """What dp_config asks of the optimizer (the same on every rank: raises before any collective)."""
    check_level(config.get("dp_config"))
    if offload_requested(config.get("dp_config")):
        check_offloadable(optimizer)


def parallelized_state(model):
    """What parallelize_model left on `model`'s parameters, or None (not parallelized)."""
    return next((getattr(p, _STATE_ATTR) for p in model.parameters() if hasattr(p, _STATE_ATTR)), None)


def _model_state(params):
    states = [getattr(p, _STATE_ATTR, None) for p in params]
    if not states or any(state is None for state in states):
        raise ValueError("parallelize_optimizer needs an optimizer over the parameters of a model parallelize_model "
                         "returned: call parallelize_model first, then build the optimizer from model.parameters()")
    distinct = {id(state): state for state in states}
    if len(distinct) > 1:
        raise ValueError("the optimizer holds parameters of several parallelized models: give each its own optimizer")
    return states[0]
