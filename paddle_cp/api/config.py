"""Build `parallelize`'s mesh and config from YAML (or a dict): the mesh by shape, plans by name.

    mesh: {shape: [2, 2], dim_names: [dp, sep]}
    dp_config: {sharding_level: 0}
    cp_config:
      parallelize_plan:
        model: {PrepareContextParallel: {backend: p2p}}
        model.layers.*.self_attn: [{ContextParallel: {backend: p2p}}]

A plan is a bare name (`ColWiseParallel`), `{Name: {argument: value}}`, or a list
of those; names are looked up in paddle_cp.plans when the config is loaded.
"""
from __future__ import annotations

import inspect
import math
from pathlib import Path

import numpy as np
import paddle.distributed as dist

from .. import plans as plans_lib
from .paddle_plans import is_paddle_plan
from .parallelize import CONFIG_KEYS


def load_config(source, world_size=None):
    """(ProcessMesh, config dict for paddle_cp.parallelize) from a YAML path or a dict.

    `world_size` defaults to the launched world size; the mesh must cover it exactly.
    """
    raw = _read(source)
    unknown = set(raw) - {"mesh", *CONFIG_KEYS}
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}: use 'mesh' and {list(CONFIG_KEYS)}")
    mesh = build_mesh(raw.get("mesh"), dist.get_world_size() if world_size is None else world_size)
    config = {}
    for key in CONFIG_KEYS:
        section = raw.get(key)
        if isinstance(section, dict) and "parallelize_plan" in section:
            plans = section["parallelize_plan"] or {}
            section = {**section, "parallelize_plan": {name: build_plans(name, spec) for name, spec in plans.items()}}
        if section is not None:
            config[key] = section  # new dicts where plans were built: the caller's stay as they were
    return mesh, config


def _read(source):
    if isinstance(source, dict):
        raw = source
    elif isinstance(source, (str, Path)):
        import yaml

        raw = yaml.safe_load(Path(source).read_text())
    else:
        raise TypeError(f"load_config takes a YAML file path or a dict, got {type(source).__name__}")
    if not isinstance(raw, dict):
        raise ValueError(f"a parallelize config is a mapping with a 'mesh' key, got {type(raw).__name__}")
    return raw


def build_mesh(spec, world_size):
    if not isinstance(spec, dict) or "shape" not in spec or "dim_names" not in spec:
        raise ValueError("the config needs mesh: {shape: [...], dim_names: [...]}, e.g. {shape: [2], dim_names: [sep]}")
    shape, names = list(spec["shape"]), list(spec["dim_names"])
    if not shape or not all(isinstance(s, int) and s > 0 for s in shape):
        raise ValueError(f"mesh shape must be a list of positive integers, got {shape}")
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ValueError(f"mesh dim_names {names} must name each of the {len(shape)} dims of shape {shape} once")
    if math.prod(shape) != world_size:
        raise ValueError(
            f"mesh shape {shape} has {math.prod(shape)} ranks but {world_size} were launched: "
            f"make the product of the shape equal the number of ranks (--nproc_per_node x nodes)"
        )
    return dist.ProcessMesh(np.arange(math.prod(shape)).reshape(shape), dim_names=names)


def known_plans():
    """Plan class names paddle_cp.plans has now."""
    return sorted(name for name, value in vars(plans_lib).items()
                  if inspect.isclass(value) and issubclass(value, plans_lib.Plan) and value is not plans_lib.Plan)


def build_plans(key, spec):
    """One plan or a list of plans for plan key `key`, from names and arguments."""
    if isinstance(spec, list):
        return [build_plan(key, item) for item in spec]
    return build_plan(key, spec)


def build_plan(key, spec):
    if isinstance(spec, plans_lib.Plan) or is_paddle_plan(spec):  # Paddle's are translated where keys are matched
        return spec
    if isinstance(spec, str):
        name, kwargs = spec, {}
    elif isinstance(spec, dict) and len(spec) == 1:
        (name, kwargs), = spec.items()
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise TypeError(f"plan {name!r} for {key!r}: arguments must be a mapping, got {kwargs!r}")
    else:
        raise TypeError(
            f"plan for {key!r} must be a name, {{Name: {{argument: value}}}} or a list of those, got {spec!r}"
        )
    cls = getattr(plans_lib, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, plans_lib.Plan)) or cls is plans_lib.Plan:
        raise ValueError(f"unknown plan {name!r} for {key!r}: known plans are {known_plans()}")
    accepted = inspect.signature(cls).parameters
    unknown = [arg for arg in kwargs if arg not in accepted]
    if unknown:
        raise TypeError(f"plan {name} for {key!r} takes no argument(s) {unknown}: it takes {list(accepted)}")
    return cls(**kwargs)
