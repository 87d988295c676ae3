"""ProcessMesh helpers: the global mesh, dim lookup, and the process group of
each mesh slice (made once, in one order, on every rank)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle.distributed as dist

_ALIASES = {"sep": ("sep", "cp"), "cp": ("sep", "cp")}
_global_mesh = None
_groups: dict = {}


def set_mesh(mesh):
    """Set the mesh `parallelize` and the functional APIs use when given none."""
    global _global_mesh
    if not isinstance(mesh, dist.ProcessMesh):
        raise TypeError(f"set_mesh expects a paddle.distributed.ProcessMesh, got {type(mesh).__name__}")
    _global_mesh = mesh
    dist.auto_parallel.set_mesh(mesh)


def get_mesh():
    """The mesh given to `set_mesh` (ours or Paddle's), or None."""
    if _global_mesh is not None:
        return _global_mesh
    return dist.auto_parallel.get_mesh()


def resolve_mesh(mesh):
    """`mesh`, else the global mesh; a clear error when there is neither."""
    mesh = mesh if mesh is not None else get_mesh()
    if mesh is None:
        raise ValueError("no ProcessMesh: pass mesh=... or call paddle_cp.set_mesh(mesh) first")
    if not isinstance(mesh, dist.ProcessMesh):
        raise TypeError(f"mesh must be a paddle.distributed.ProcessMesh, got {type(mesh).__name__}")
    return mesh


def find_dim(mesh, name):
    """The mesh's spelling of dim `name` (`sep` and `cp` are aliases), or None."""
    for candidate in _ALIASES.get(name, (name,)):
        if candidate in mesh.dim_names:
            return candidate
    return None


def require_dim(mesh, name, purpose):
    found = find_dim(mesh, name)
    if found is None:
        raise ValueError(
            f"{purpose} needs a mesh dim named '{name}'; this mesh has dims {list(mesh.dim_names)}. "
            f"Build it as dist.ProcessMesh(..., dim_names=[..., '{name}'])"
        )
    return found


def dim_size(mesh, name):
    """Size of dim `name` (1 when the mesh has no such dim)."""
    found = find_dim(mesh, name)
    return 1 if found is None else mesh.shape[mesh.dim_names.index(found)]


def ensure_initialized():
    """Start the parallel env if the script did not (init_parallel_env is idempotent only in name)."""
    if not dist.is_initialized():
        dist.init_parallel_env()


@dataclass(frozen=True)
class MeshGroup:
    """This rank's slice of a mesh along some dims.

    `ranks` are global ranks in mesh order (the order that defines positions in
    a ring or a sequence layout); `index` is this rank's position among them;
    `group` is Paddle's Group (None for a one-rank slice).
    """

    ranks: tuple
    index: int
    group: object

    @property
    def size(self):
        return len(self.ranks)

    def rank_at(self, index):
        return self.ranks[index % self.size]


def _slices(mesh_array, axes):
    """All slices of the mesh varying over `axes`, as rank tuples in mesh order."""
    other = [a for a in range(mesh_array.ndim) if a not in axes]
    moved = np.transpose(mesh_array, other + list(axes))
    flat = moved.reshape(-1, int(np.prod([mesh_array.shape[a] for a in axes], dtype=int)))
    return [tuple(int(r) for r in row) for row in flat]


def mesh_group(mesh, dims):
    """This rank's MeshGroup over mesh dims `dims` (names; missing dims are skipped).

    Every rank must call this at the same point: the first call for a (mesh, dims)
    pair creates the groups of all slices, in one order on every rank.
    """
    ensure_initialized()
    names = [find_dim(mesh, d) for d in dims]
    axes = sorted({mesh.dim_names.index(n) for n in names if n is not None})
    key = (tuple(mesh.process_ids), tuple(mesh.shape), tuple(axes))
    if key not in _groups:
        _groups[key] = _create_groups(np.asarray(mesh.mesh), axes)
    return _groups[key]


def _create_groups(mesh_array, axes):
    rank = dist.get_rank()
    mine = None
    for ranks in _slices(mesh_array, axes):
        group = None
        if len(ranks) > 1:
            group = dist.new_group(list(ranks))
            # gloo's rendezvous mixes up groups created back to back: settle each one.
            dist.barrier()
        if rank in ranks:
            mine = MeshGroup(ranks, ranks.index(rank), group)
    if mine is None:
        raise ValueError(f"rank {rank} is not in the mesh {mesh_array.tolist()}: the mesh must cover every launched rank")
    return mine


__all__ = ["set_mesh", "get_mesh", "resolve_mesh", "find_dim", "require_dim", "dim_size", "mesh_group", "MeshGroup"]
