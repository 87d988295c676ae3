"""PaddleFormers' parallel flags as paddle_cp degrees, and the mesh they make.

`context_parallel_size` is the ring (`p2p`), `sep_parallel_size` Ulysses
(`all2all`), both together the hybrid of the two on one `sep` dim;
`tensor_model_parallel_size` is `mp`, `pipeline_model_parallel_size` is `pp`,
and the ranks left over are `dp`. `sharding` stages 1-3 shard over every rank
holding a replica (dp x sep; `sharding_parallel_size` equal to dp: over dp only).
`expert_model_parallel_size` (with `use_expert_parallel`) is ep_config's degree: expert
groups folded onto the dp x sep ranks, not ranks of their own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import paddle.distributed as dist

# mesh dims outermost first: tensor parallel innermost (the busiest traffic between neighbours)
DIM_ORDER = ("dp", "pp", "sep", "mp")
SHARDING_STAGES = {"stage1": 1, "stage2": 2, "stage3": 3}


@dataclass(frozen=True)
class ParallelDegrees:
    world: int
    dp: int = 1
    pp: int = 1
    mp: int = 1
    ring: int = 1  # context_parallel_size
    ulysses: int = 1  # sep_parallel_size
    sharding_level: int = 0
    sharding_mesh_dim: Optional[str] = None  # dp_config's: None shards over dp x sep
    sequence_parallel: bool = False
    ep: int = 1  # expert_model_parallel_size: ranks of an expert group, folded onto dp x sep

    @property
    def sep(self):
        return self.ring * self.ulysses

    @property
    def backend(self):
        """The context-parallel backend, or None without context parallelism."""
        if self.ring > 1 and self.ulysses > 1:
            return "hybrid"
        return "p2p" if self.ring > 1 else "all2all" if self.ulysses > 1 else None

    @property
    def parallel(self):
        return self.world > 1

    def mesh(self):
        """dims of size > 1 in DIM_ORDER; a one-rank run has no mesh."""
        if not self.parallel:
            return None
        dims = [(name, getattr(self, name)) for name in DIM_ORDER if getattr(self, name) > 1]
        shape = [size for _, size in dims]
        return dist.ProcessMesh(np.arange(self.world).reshape(shape).tolist(), dim_names=[n for n, _ in dims])


def _size(value):
    """PaddleFormers writes 'unset' as -1 (or 0)."""
    return max(int(value), 1)


def sharding_level(sharding):
    """The stage of PaddleFormers' `sharding` flag ("stage2", ["stage2"], True = stage1, "" = none)."""
    if isinstance(sharding, bool):
        return 1 if sharding else 0
    options = sharding.split() if isinstance(sharding, str) else [getattr(s, "value", s) for s in sharding]
    if "offload" in options:
        raise ValueError("sharding 'offload' is not supported by paddle_cp's Trainer: drop 'offload' from --sharding")
    unknown = [o for o in options if o not in SHARDING_STAGES]
    if unknown or len(options) > 1:
        raise ValueError(f"--sharding {sharding!r}: give one of {sorted(SHARDING_STAGES)} (or nothing)")
    return SHARDING_STAGES[options[0]] if options else 0


def degrees_from_flags(world, *, context_parallel_size=-1, sep_parallel_size=-1, tensor_model_parallel_size=-1,
                       pipeline_model_parallel_size=-1, sharding="", sharding_parallel_size=-1,
                       sequence_parallel=False, use_expert_parallel=False, expert_model_parallel_size=-1):
    """ParallelDegrees for `world` ranks; a ValueError naming the fix when the flags do not fit it.

    Pure arithmetic on the flags: every rank raises the same error, before any collective.
    """
    ring, ulysses = _size(context_parallel_size), _size(sep_parallel_size)
    mp, pp = _size(tensor_model_parallel_size), _size(pipeline_model_parallel_size)
    level = sharding_level(sharding)
    model_ranks = pp * mp * ring * ulysses
    if world % model_ranks:
        raise ValueError(
            f"parallel degrees do not fit {world} ranks: pipeline_model_parallel_size {pp} x "
            f"tensor_model_parallel_size {mp} x context_parallel_size {ring} x sep_parallel_size {ulysses} = "
            f"{model_ranks} must divide the world size (the ranks left over are data parallel); change the sizes "
            f"or launch a multiple of {model_ranks} ranks")
    dp = world // model_ranks
    if sequence_parallel and mp == 1:
        raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1 (it splits the sequence over the "
                         "tensor-parallel ranks): set both or neither")
    shard_size, replicas = int(sharding_parallel_size), dp * ring * ulysses
    if level and shard_size > 1 and shard_size not in (replicas, dp):
        dp_only = f" or {dp} (the dp ranks only)" if dp != replicas else ""
        raise ValueError(
            f"sharding_parallel_size {shard_size} fits no sharding group: paddle_cp shards over the ranks holding "
            f"replicas; set sharding_parallel_size to {replicas} (dp x context-parallel ranks, as -1 does){dp_only}")
    mesh_dim = "dp" if level and shard_size == dp != replicas else None
    if level and (dp if mesh_dim else replicas) == 1:
        level = 0  # as PaddleFormers: sharding over one rank is no sharding
    if level > 1 and pp > 1:
        raise ValueError("sharding stage2/stage3 with pipeline_model_parallel_size > 1 is not supported "
                         "(as in PaddleFormers): use --sharding stage1")
    return ParallelDegrees(world=world, dp=dp, pp=pp, mp=mp, ring=ring, ulysses=ulysses, sharding_level=level,
                           sharding_mesh_dim=mesh_dim, sequence_parallel=bool(sequence_parallel),
                           ep=_expert_degree(use_expert_parallel, expert_model_parallel_size, dp * ring * ulysses))


def _expert_degree(use_expert_parallel, size, folded):
    """ep_config's degree: expert_model_parallel_size when use_expert_parallel (PaddleFormers asks for both)."""
    size = _size(size)
    if size > 1 and not use_expert_parallel:
        raise ValueError(f"expert_model_parallel_size {size} needs use_expert_parallel=True (as in PaddleFormers): "
                         "set both or neither")
    if folded % size:
        raise ValueError(f"expert_model_parallel_size {size} must divide the {folded} data x context parallel ranks "
                         "(expert groups fold onto them, never onto tensor or pipeline ranks): choose a divisor "
                         f"of {folded}")
    return size if use_expert_parallel else 1


def degrees_from_mesh(mesh, sharding_level=0):
    """ParallelDegrees read off a user's mesh (a paddle_cp config brings its own mesh and plans)."""
    size = {name: mesh.shape[i] for i, name in enumerate(mesh.dim_names)}
    sep = size.get("sep", size.get("cp", 1))
    return ParallelDegrees(world=int(np.prod(mesh.shape)), dp=size.get("dp", 1), pp=size.get("pp", 1),
                           mp=size.get("mp", 1), ring=sep, sharding_level=int(sharding_level))
