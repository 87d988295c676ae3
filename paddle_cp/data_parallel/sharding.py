"""dp_config sharding levels (ZeRO stages) over the ranks holding replicas of a parameter.

A parameter's data replicas are its `Partial("avg")` placement (params.py): the dp and sep ranks,
each fed its own tokens (for an expert, the ranks holding the same experts). Sharding replaces it
by `Owned`: over the replicas along the dims `sharding_mesh_dim` chooses (all of them unless it
says `dp` or `sep`), one position owns the parameter (greedy, by size, so owners carry about equal
bytes); the ranks along the dims it leaves out (`rest`) still average the owner's gradient.
- level 1: only the owner keeps the parameter's optimizer state and steps it;
  then it broadcasts the new value to the other ranks it shards over.
- level 2: also gradients: they are reduce-scattered so each rank receives only
  the summed gradients of the parameters it owns (a reduce-scatter per gradient bucket over
  all the replicas, during backward where it can: buckets.py; over the chosen dims, then an
  average over the rest), and the full gradients are freed then.
- level 3: also parameters: non-owners keep an empty placeholder; the full value
  is fetched from the owner for each layer's forward and again for its backward,
  and freed after each (parameter_fetch.py); a fetch unit (params.mark_fetch_unit: a MoE
  block's experts, which run on data-dependent rows) fetches its sublayers' together. Gradients computed on non-owners are
  stashed and reduce-scattered as at level 2.
With dp_config `offload_optimizer` (host_optimizer.py) the owner's state is in host memory and stepped there.
"""
from __future__ import annotations

import math
import warnings

from .. import mesh as mesh_lib
from ..comm import collectives
from .buckets import bucket_size_mb, gradient_dtype
from .held_bytes import HeldBytes
from .host_optimizer import offload_requested
from .optimizer import OwnGradients
from .parameter_fetch import fetch_around
from ..params import DATA_DIMS, Owned, Partial, is_fetch_unit, record_of, release_value

LEVELS = (0, 1, 2, 3)
SHARDABLE_DIMS = ("dp", "sep", "cp")  # the data dims (params.DATA_DIMS; `cp` is sep's alias)


def check_level(dp_config):
    """The sharding level of a dp_config, every key checked (the dims by `sharding_dims`)."""
    dp_config = dp_config or {}
    if not isinstance(dp_config, dict):
        raise TypeError(f"dp_config must be a dict like {{'sharding_level': 1}}, got {type(dp_config).__name__}")
    unknown = set(dp_config) - {"sharding_level", "sharding_mesh_dim", "bucket_size_mb", "offload_optimizer"}
    if unknown:
        raise ValueError(f"dp_config has unknown keys {sorted(unknown)}: it takes only 'sharding_level', "
                         "'sharding_mesh_dim', 'bucket_size_mb' and 'offload_optimizer'")
    sharding_dims(dp_config)
    bucket_size_mb(dp_config)
    offload_requested(dp_config)
    level = dp_config.get("sharding_level", 0)
    if level not in LEVELS:
        raise ValueError(f"dp_config sharding_level must be one of {LEVELS}, got {level!r}")
    return level


def sharding_dims(dp_config):
    """The mesh dims sharding spans: `sharding_mesh_dim` ("dp", "sep" or a list of them); by default (None, as
    PaddleFormers passes it) every data dim, so each parameter is sharded over all the ranks holding a replica."""
    dims = (dp_config or {}).get("sharding_mesh_dim")
    if dims is None:
        return DATA_DIMS
    listed = [dims] if isinstance(dims, str) else list(dims) if isinstance(dims, (list, tuple)) else None
    if not listed or any(d not in SHARDABLE_DIMS for d in listed) or len(set(listed)) < len(listed):
        raise ValueError(f"dp_config sharding_mesh_dim {dims!r}: give 'dp', 'sep' or a list of them (the dims whose "
                         "ranks hold replicas), or leave it out to shard over both")
    return tuple(listed)


def owners(params, size):
    """Owner position of each parameter: largest first onto the least-loaded rank (same on every rank)."""
    load, owner = [0] * size, [None] * len(params)
    sizes = [math.prod(p.shape) for p in params]  # from shapes: a lazy parameter has no numel() yet
    for i in sorted(range(len(params)), key=lambda i: (-sizes[i], i)):
        rank = min(range(size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += sizes[i]
    return owner


def data_replicas(record):
    """The parameter's data-replica placement (Partial "avg"), or None."""
    return next((p for p in record.find(Partial) if p.reduce == "avg"), None)


def split_replicas(parallel_dims, replicas, dims):
    """(shard group, rest) of a replica group: its ranks along the mesh dims `dims` and along its other dims
    (None when `dims` span it all). A group folded from dims (not a whole slice of them) is sharded whole
    when `dims` cover them, else not at all (shard group None). The groups from `parallel_dims`
    (declared by `sharding_groups_needed`)."""
    mesh = parallel_dims.mesh
    chosen = [d for d in replicas.group.dims if d in {mesh_lib.find_dim(mesh, n) for n in dims}]
    if len(chosen) == len(replicas.group.dims):
        return replicas.group, None
    whole = replicas.group.size == math.prod(mesh_lib.dim_size(mesh, d) for d in replicas.group.dims)
    if not chosen or not whole:
        return None, None
    others = [d for d in replicas.group.dims if d not in chosen]
    return parallel_dims.group(tuple(chosen)), parallel_dims.group(tuple(others))


def sharding_groups_needed(level, mesh, dims):
    """The groups `split_replicas` cuts the whole data replicas (dp x sep) into when `dims` choose part of
    them (ParallelDims.build's needs); the parts of a single dim or of a fold are never cut."""
    data = {mesh_lib.find_dim(mesh, d) for d in DATA_DIMS} - {None}
    chosen = {mesh_lib.find_dim(mesh, d) for d in dims} & data
    if level == 0 or not chosen or chosen == data:
        return ()
    return (("group", tuple(chosen)), ("group", tuple(data - chosen)))


def owned(param):
    """The parameter's Owned placement, or None (not sharded)."""
    return next(iter(record_of(param).find(Owned)), None)


def shard_parameters(level, params, parallel_dims, dims):
    """The Sharding of `params` at `level` over the mesh dims `dims` (groups from `parallel_dims`), or None: at
    level 0, and with a warning naming why when no parameter has more than one replica there (every rank
    would keep everything)."""
    if level == 0:
        return None
    mesh = parallel_dims.mesh
    sharding = Sharding(level, params, parallel_dims, dims)
    if sharding.sharded:
        return sharding
    sizes = ", ".join(f"{d}={mesh_lib.dim_size(mesh, d)}" for d in dims)
    kept = "optimizer state and parameters" if level == 3 else "optimizer state"
    warnings.warn(f"dp_config sharding_level {level} shards nothing: it shards each parameter over the ranks "
                  f"holding its replicas along mesh dims {sizes} (mesh {dict(zip(mesh.dim_names, mesh.shape))}), "
                  f"and no parameter has more than one there, so every rank keeps the whole {kept}. Give the "
                  "mesh dp or sep ranks (or sharding_mesh_dim a dim that has them), or set sharding_level 0",
                  stacklevel=3)
    return None


class Sharding:
    """The level's reduce/update steps; each parameter's owner is in its record (an Owned placement)."""

    def __init__(self, level, params, parallel_dims, dims=DATA_DIMS):
        self.level, self.params = level, list(params)
        # frozen parameters (a LoRA model's base weights) have no gradient and never change: they are left
        # out of the gradient and update traffic, and balanced apart so the trained ones' state is balanced too
        self.trained = [p for p in self.params if not p.stop_gradient]
        frozen = [p for p in self.params if p.stop_gradient]
        for part in (self.trained, frozen):
            by_group = {}  # shard group's ranks -> (shard group, [(param, replicas, rest)])
            for param in part:
                replicas = data_replicas(record_of(param))
                shard_group, rest = split_replicas(parallel_dims, replicas, dims) if replicas else (None, None)
                if shard_group is not None and shard_group.size > 1:
                    by_group.setdefault(shard_group.ranks, (shard_group, []))[1].append((param, replicas, rest))
            for shard_group, members in by_group.values():
                for (param, replicas, rest), owner in zip(members, owners([m[0] for m in members], shard_group.size)):
                    record_of(param).replace(replicas, Owned(replicas.group, shard_group, rest, owner, level))
        self.sharded = [p for p in self.params if owned(p) is not None]
        self._stash = {}  # level 3: gradients of parameters this rank does not own
        self.gathered = HeldBytes()  # level 3: full copies fetched for use

    @staticmethod
    def owns(param):
        placement = owned(param)
        return placement is None or placement.owner_here()

    def gradient(self, p):
        """This rank's gradient of `p`: at level 3 a non-owner's is in the stash until its bucket is reduced."""
        return self._stash.get(id(p)) if self.level == 3 and not self.owns(p) else p.grad

    def release(self, p):
        """Free this rank's gradient of `p`: its bucket holds it now."""
        self._stash.pop(id(p), None)
        OwnGradients.release(p)

    def drop_foreign_gradients(self):
        """Free the gradients of parameters another rank owns: the inner optimizer then skips them
        (and never creates their state)."""
        for p in self.params:
            if not self.owns(p) and p.grad is not None:
                p.clear_gradient(False)

    def sync_parameters(self):
        """Levels 1-2: every rank it is sharded over gets each parameter's new value from its owner."""
        if self.level in (1, 2):
            for p in self.trained:
                placement = owned(p)
                if placement is not None:
                    collectives.broadcast(placement.shard_group, p, placement.owner, tag="param_broadcast")

    # level 3 -----------------------------------------------------------------

    def release_parameters(self, model):
        """Keep only owned parameters; fetch the others around each layer's forward."""
        for p in self.params:
            if not self.owns(p):
                release_value(p)
        sharded = {id(p) for p in self.sharded}
        inside_unit = set()  # layers whose parameters a fetch unit around them fetches
        for layer in model.sublayers(include_self=True):  # pre-order: a unit comes before its sublayers
            if id(layer) in inside_unit:
                continue
            holders = layer.sublayers(include_self=True) if is_fetch_unit(layer) else [layer]
            inside_unit.update(id(holder) for holder in holders)
            members = [(holder, n) for holder in holders for n, p in holder._parameters.items()
                       if p is not None and id(p) in sharded]
            if members:
                fetch_around(layer, members, self)

    def clear_stash(self):
        self._stash.clear()

    def scale_stash(self, factor):
        self._stash = {key: grad * factor for key, grad in self._stash.items()}

    def stash(self, param, grad):
        """Level 3: add a non-owner's gradient of `param` to its stash, in `gradient_dtype` (fp32 master
        gradients accumulate in fp32 over micro-batches, as the owner's `.grad` does)."""
        key = id(param)
        dtype = gradient_dtype(param)
        grad = grad if grad.dtype == dtype else grad.astype(dtype)
        self._stash[key] = grad if key not in self._stash else self._stash[key] + grad
