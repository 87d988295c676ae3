"""The process groups context-parallel attention runs over: `sep`, split into Ulysses and ring parts."""
from __future__ import annotations

from dataclasses import dataclass

from ... import mesh as mesh_lib


@dataclass(frozen=True)
class CPGroups:
    """The sep group and its Ulysses (inner) and ring (outer) parts."""

    sep: mesh_lib.MeshGroup
    ulysses: mesh_lib.MeshGroup
    ring: mesh_lib.MeshGroup


def _alone(group):
    rank = group.ranks[group.index]
    return mesh_lib.MeshGroup((rank,), 0, None)


def _dims(mesh):
    """The ParallelDims of `mesh` (a ParallelDims, a ProcessMesh, or None: the global mesh); a mesh without a
    sep dim is refused before any group is made."""
    if not isinstance(mesh, mesh_lib.ParallelDims):
        mesh_lib.require_dim(mesh_lib.resolve_mesh(mesh), "sep", "context parallelism")
    return mesh_lib.dims_of(mesh)


def resolve_group(mesh=None, group=None):
    """The context-parallel MeshGroup: `group` (MeshGroup or Paddle Group), else the mesh's `sep` slice
    (`mesh`: a ParallelDims, a ProcessMesh, or None for the global mesh)."""
    if group is not None:
        if isinstance(group, mesh_lib.MeshGroup):
            return group
        return mesh_lib.MeshGroup(tuple(group.ranks), group.rank, group)
    return _dims(mesh).with_pairs("sep")


def resolve_groups(layout, mesh=None, group=None):
    """CPGroups for a layout; hybrid groups come from the mesh (all slices are made collectively)."""
    sep = resolve_group(mesh, group)
    if layout.ulysses == 1:
        return CPGroups(sep, _alone(sep), sep)
    if layout.ring == 1:
        return CPGroups(sep, sep, _alone(sep))
    if group is not None:
        raise ValueError("backend='hybrid' builds its Ulysses and ring groups from the mesh: pass mesh=, not group=")
    ulysses, ring = _dims(mesh).sep_parts(layout.ulysses)
    return CPGroups(sep, ulysses, ring)
