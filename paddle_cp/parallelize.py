"""`parallelize(model, optimizer, mesh, config)`: apply the parallelisms in order.

Order: tensor and sequence plans (mp_config) with the context-parallel plans
(cp_config) merged in after them, then data parallel (dp_config): parameters
are made identical across replicas and the optimizer reduces gradients.
"""
from __future__ import annotations

from . import mesh as mesh_lib
from .comm import collectives
from .optimizer import ParallelOptimizer
from .plan_keys import resolve_plan

CONFIG_KEYS = ("dp_config", "mp_config", "pp_config", "cp_config")


def _merged_plan(config):
    """mp plans then cp plans, without touching the user's dicts (Paddle mutates them)."""
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
                raise ValueError(f"plan key {name!r} is given in both mp_config and cp_config: give it once")
            plan[name] = plans
    return plan


def _check_config(config):
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown parallelize config keys {sorted(unknown)}: use {list(CONFIG_KEYS)}")
    if config.get("pp_config"):
        raise ValueError("pp_config is not supported by paddle_cp yet: drop it, or use Paddle's own parallelize for pipelines")
    level = (config.get("dp_config") or {}).get("sharding_level", 0)
    if level != 0:
        raise ValueError(f"dp_config sharding_level {level} is not supported yet: use sharding_level 0")


def broadcast_parameters(model, replica_group):
    """Start every replica from the first one's parameters, as one card would."""
    for param in model.parameters():
        collectives.broadcast(replica_group, param, 0, op="param_broadcast")


def parallelize(model, optimizer=None, mesh=None, config=None):
    """Parallelize `model` (in place) and wrap `optimizer`; returns (model, optimizer)."""
    config = dict(config or {})
    _check_config(config)
    if mesh is not None:
        mesh_lib.set_mesh(mesh)
    if not any(config.get(key) for key in CONFIG_KEYS):
        return model, optimizer
    mesh = mesh_lib.resolve_mesh(mesh)
    matched = resolve_plan(model, _merged_plan(config))  # validates every plan before any collective
    for name, layer, plans, params in matched:
        for plan in plans:
            plan.apply(layer, mesh, params)
    replicas = mesh_lib.mesh_group(mesh, ["dp", "sep"])
    broadcast_parameters(model, replicas)
    if optimizer is not None:
        optimizer = ParallelOptimizer(optimizer, replicas)
    return model, optimizer
