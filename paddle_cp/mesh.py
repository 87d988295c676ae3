"""ProcessMesh helpers: the global mesh, dim lookup, and the process group of
each mesh slice (made once, in one order, on every rank)."""
from __future__ import annotations

import itertools
import socket
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np
import paddle
import paddle.distributed as dist

from . import runtime
from .comm.watchdog import startup_guard  # the one import from comm: the watchdog imports nothing of the package

_ALIASES = {"sep": ("sep", "cp"), "cp": ("sep", "cp")}


def set_mesh(mesh):
    """Set the mesh `parallelize` and the functional APIs use when given none: Paddle's global mesh,
    so `dist.auto_parallel.get_mesh()` sees it too."""
    if not isinstance(mesh, dist.ProcessMesh):
        raise TypeError(f"set_mesh expects a paddle.distributed.ProcessMesh, got {type(mesh).__name__}")
    dist.auto_parallel.set_mesh(mesh)


def get_mesh():
    """Paddle's global mesh (from `set_mesh` here or `dist.auto_parallel.set_mesh`), or None."""
    return dist.auto_parallel.get_mesh()


def resolve_mesh(mesh):
    """`mesh`, else the global mesh; a clear error when there is neither."""
    mesh = mesh if mesh is not None else get_mesh()
    if mesh is None:
        raise ValueError("no ProcessMesh: pass mesh=... or call paddle_cp.set_mesh(mesh) first")
    if not isinstance(mesh, dist.ProcessMesh):
        raise TypeError(f"mesh must be a paddle.distributed.ProcessMesh, got {type(mesh).__name__}")
    return mesh


def same_mesh(a, b):
    """Equal shape, ranks and dim names (ProcessMesh's own == ignores the dim names)."""
    return (list(a.shape), list(a.process_ids), list(a.dim_names)) == (list(b.shape), list(b.process_ids),
                                                                       list(b.dim_names))


def coordinates(mesh):
    """This rank's index along each dim of `mesh` (no process group needed)."""
    ranks = np.asarray(mesh.process_ids).reshape(mesh.shape)
    return tuple(int(i) for i in np.argwhere(ranks == dist.get_rank())[0])


def find_dim(mesh, name):
    """The mesh's spelling of dim `name` (`sep` and `cp` are aliases), or None."""
    for candidate in _ALIASES.get(name, (name,)):
        if candidate in mesh.dim_names:
            return candidate
    return None


def require_dim(mesh, name, purpose):
    found = find_dim(mesh, name)
    if found is None:
        others = [f"'{alias}'" for alias in _ALIASES.get(name, ()) if alias != name]
        also = f" ({' or '.join(others)} is accepted too)" if others else ""
        raise ValueError(
            f"{purpose} needs a mesh dim named '{name}'{also}; this mesh has dims {list(mesh.dim_names)}. "
            f"Build it as dist.ProcessMesh(..., dim_names=[..., '{name}'])"
        )
    return found


def dim_size(mesh, name):
    """Size of dim `name` (1 when the mesh has no such dim)."""
    found = find_dim(mesh, name)
    return 1 if found is None else mesh.shape[mesh.dim_names.index(found)]


def ensure_initialized():
    """Start the parallel env if the script did not (init_parallel_env is idempotent only in name); it waits
    for every rank, so under the watchdog like every collective."""
    if not dist.is_initialized():
        with startup_guard("init_parallel_env", range(dist.get_world_size())):
            dist.init_parallel_env()


def require_launched_ranks(mesh):
    """The mesh holds every launched rank once: checked alike on every rank before any group is made (a rank
    the launch lacks, or one left out of the mesh, would leave the others waiting in a group's rendezvous)."""
    world = dist.get_world_size()
    ranks = [int(r) for r in mesh.process_ids]
    if sorted(ranks) == list(range(world)):
        return
    missing = sorted(set(range(world)) - set(ranks))
    beyond = sorted(set(ranks) - set(range(world)))
    wrong = "; ".join(part for part in (f"ranks {beyond} are not launched" if beyond else "",
                                        f"launched ranks {missing} are not in it" if missing else "",
                                        "it names a rank twice" if len(set(ranks)) < len(ranks) else "") if part)
    raise ValueError(f"the mesh {list(mesh.shape)} {list(mesh.dim_names)} holds {len(ranks)} rank(s) but {world} are "
                     f"launched ({wrong}): build it over every launched rank once, e.g. "
                     f"dist.ProcessMesh(np.arange({world}).reshape(shape), dim_names=...) with a shape whose "
                     f"product is {world}, or launch {len(ranks)} rank(s) (--nproc_per_node {len(ranks)})")


@dataclass(frozen=True)
class MeshGroup:
    """This rank's slice of a mesh along some dims.

    `ranks` are global ranks in mesh order (the order that defines positions in
    a ring or a sequence layout); `index` is this rank's position among them;
    `group` is Paddle's Group (None for the default group, or a one-rank
    slice); `pairs` holds a two-rank group per peer where gloo's
    point-to-point traffic needs them (see needs_pair_groups); `dims` names the
    mesh dims the group was made from (a `fold_groups` part spans them only partly;
    a hand-made group or a line's subgroup names none); `kind` is the same on every
    rank for the slices made together (whatever their ranks): where a rank reduces over
    several groups, it goes through them in the order of their kinds, so every rank
    sums the same values (in another order, ranks would add partial sums of partial sums).
    """

    ranks: tuple
    index: int
    group: object
    pairs: dict = field(default_factory=dict, compare=False, repr=False)
    dims: tuple = field(default=())  # compared: the slices of two size-1 dims have the same ranks but are not one
    kind: str = field(default="", compare=False, repr=False)

    @property
    def size(self):
        return len(self.ranks)

    def rank_at(self, index):
        return self.ranks[index % self.size]

    def p2p_group(self, peer_rank):
        """The group to talk to `peer_rank` over: its pair group if there is one."""
        if not self.pairs:
            return self.group
        return self.pairs[frozenset((self.ranks[self.index], peer_rank))]


def _slices(mesh_array, axes):
    """All slices of the mesh varying over `axes`, as rank tuples in mesh order."""
    other = [a for a in range(mesh_array.ndim) if a not in axes]
    moved = np.transpose(mesh_array, other + list(axes))
    flat = moved.reshape(-1, int(np.prod([mesh_array.shape[a] for a in axes], dtype=int)))
    return [tuple(int(r) for r in row) for row in flat]


def mesh_group(mesh, dims, p2p=False):
    """This rank's MeshGroup over mesh dims `dims` (names; missing dims are skipped).

    Every rank must call this at the same point: the first call for a (mesh, dims)
    pair creates the groups of all slices, in one order on every rank. `p2p=True`
    also creates the pair groups gloo needs for point-to-point traffic.
    """
    ensure_initialized()
    require_launched_ranks(mesh)
    axes = _axes(mesh, dims)
    key = (tuple(mesh.process_ids), tuple(mesh.shape), tuple(axes))
    return _slice_group(key, np.asarray(mesh.mesh), axes, p2p, _names(mesh, axes))


def fold_groups(mesh, dims, inner):
    """(inner, outer) MeshGroups of the ranks of mesh dims `dims` taken together, numbered row-major in
    mesh order and cut into blocks of `inner` consecutive positions: `inner` varies within a block
    (position % inner), `outer` across blocks (position // inner). Folding dp x sep into expert groups
    of E ranks gives the expert group (inner) and the ranks holding the same experts (outer).
    Collective like mesh_group; `inner` must divide the folded size."""
    ensure_initialized()
    require_launched_ranks(mesh)
    axes = _axes(mesh, dims)
    array = np.asarray(mesh.mesh)
    other = [a for a in range(array.ndim) if a not in axes]
    folded = int(np.prod([array.shape[a] for a in axes], dtype=int))
    if inner < 1 or folded % inner:
        raise ValueError(f"cannot cut the {folded} ranks of mesh dims {list(dims)} into blocks of {inner}: "
                         f"choose a size that divides {folded}")
    # [other dims..., folded dims...] -> [other dims..., folded / inner, inner]
    cut = np.transpose(array, other + axes).reshape([array.shape[a] for a in other] + [folded // inner, inner])
    key = (tuple(mesh.process_ids), tuple(mesh.shape), ("fold", tuple(axes), inner))
    names, last = _names(mesh, axes), len(other)
    return (_slice_group(key + ("inner",), cut, [last + 1], True, names),
            _slice_group(key + ("outer",), cut, [last], True, names))


def split_dim_groups(mesh, dim, inner):
    """(inner, outer) MeshGroups of mesh dim `dim` cut into blocks of `inner` consecutive positions."""
    return fold_groups(mesh, [dim], inner)


def _axes(mesh, dims):
    """The mesh axes of dim names `dims` (missing ones skipped), in mesh order."""
    names = [find_dim(mesh, d) for d in dims]
    return sorted({mesh.dim_names.index(n) for n in names if n is not None})


def _names(mesh, axes):
    return tuple(mesh.dim_names[a] for a in axes)


def _slice_group(key, mesh_array, axes, p2p, dims):
    slices = _slices(mesh_array, axes)
    groups = runtime.installed.groups  # made once per process: reset keeps them (runtime.py)
    if key not in groups:
        groups[key] = _create_groups(slices)
    mine = groups[key]
    if p2p and needs_pair_groups(mine.size) and not mine.pairs and paddle.get_device() == "cpu":
        _create_pairs(slices, mine)
    # the groups are shared by meshes of the same ranks and shape, whatever their dims are called
    return replace(mine, dims=dims, kind=repr(key))


class ParallelDims:
    """The named process groups of one mesh, each made once (torchtitan's ParallelDims). `parallelize` builds
    what its run declares (`Plan.groups_needed`, the pipeline's, sharding's and placement completion's needs)
    in one sorted order on every rank before any plan applies (new_group is collective); runtime.installed
    keeps it (`dims_of`). Plans and the front door read its groups instead of cutting the mesh by dim names.
    A group nothing declared is made on first use: the function API's path, where every rank calls at the
    same point.

    A need is a tuple: ("group", dims) with dims a field name below or a tuple of mesh dim names;
    ("pairs", name) the group `name` with gloo's pair groups; ("sep_parts", ulysses); ("fold", dims, degree);
    ("line", dim, positions). A dim the mesh lacks is left out (a one-rank group in effect). The fields:
    `world` every dim; `data` dp x sep (the ranks sharing a token mean, expert folding, sharding); `dp`,
    `sep`, `mp`, `pp` one dim; `stage` every dim but pp (one pipeline stage); `replica` every dim but pp
    and dp (one data-parallel replica of a stage)."""

    def __init__(self, mesh):
        self.mesh = mesh
        self._made = {}  # canonical need -> what it made

    def build(self, needs):
        """Make the groups `needs` names, in one order whatever order they were given in."""
        for key in sorted({self._canonical(need) for need in needs}, key=repr):
            self._get(key)
        return self

    def built(self):
        """The canonical needs made so far, in their order of creation."""
        return list(self._made)

    def group(self, dims):
        """The MeshGroup over `dims` (a field name or mesh dim names)."""
        return self._get(self._canonical(("group", dims)))

    world = property(lambda self: self.group("world"))
    data = property(lambda self: self.group("data"))
    dp = property(lambda self: self.group("dp"))
    sep = property(lambda self: self.group("sep"))
    mp = property(lambda self: self.group("mp"))
    pp = property(lambda self: self.group("pp"))
    stage = property(lambda self: self.group("stage"))
    replica = property(lambda self: self.group("replica"))

    def with_pairs(self, name):
        """The group `name` (sep, mp, data) with the pair groups gloo's point-to-point traffic needs."""
        return self._get(self._canonical(("pairs", name)))

    def sep_parts(self, ulysses):
        """(ulysses, ring): sep cut into blocks of `ulysses` consecutive ranks (inner) and across them (outer)."""
        return self._get(("sep_parts", ulysses))

    def fold(self, dims, degree):
        """(inner, outer) of mesh dims `dims` folded and cut into blocks of `degree` (fold_groups)."""
        return self._get(self._canonical(("fold", dims, degree)))

    def line(self, dim, positions):
        """This rank's group over `positions` of its line along `dim`, or None when it is not among them."""
        return self._get(self._canonical(("line", dim, positions)))

    def position(self, dim):
        """This rank's coordinate along `dim` (0 when the mesh lacks it); no group needed."""
        found = find_dim(self.mesh, dim)
        return 0 if found is None else coordinates(self.mesh)[self.mesh.dim_names.index(found)]

    def _dims(self, dims):
        """Mesh dim names (a field name or names; aliases resolved, missing dropped) in mesh order."""
        names = self.mesh.dim_names
        if isinstance(dims, str):
            dims = _FIELD_DIMS[dims](names) if dims in _FIELD_DIMS else (dims,)
        return tuple(names[a] for a in _axes(self.mesh, dims))

    def _canonical(self, need):
        kind, *args = need
        if kind in ("group", "pairs"):
            return (kind, self._dims(args[0]))
        if kind == "fold":
            return (kind, self._dims(tuple(args[0])), args[1])
        if kind == "line":
            return (kind, self._dims(args[0])[0], tuple(args[1]))
        if kind == "sep_parts":
            return (kind, args[0])
        raise ValueError(f"unknown group need {need!r}")

    def _get(self, key):
        if key not in self._made:
            self._made[key] = self._make(*key)
        return self._made[key]

    def _make(self, kind, *args):
        if kind == "group":
            return mesh_group(self.mesh, list(args[0]))
        if kind == "pairs":
            made = mesh_group(self.mesh, list(args[0]), p2p=True)
            self._made.setdefault(("group", args[0]), made)  # the plain group is the same slice
            return made
        if kind == "sep_parts":
            return split_dim_groups(self.mesh, "sep", args[0])
        if kind == "fold":
            return fold_groups(self.mesh, list(args[0]), args[1])
        return line_subgroups(self.mesh, args[0], [args[1]])[args[1]]


# the dims of ParallelDims' named fields, from the mesh's dim names
_FIELD_DIMS = MappingProxyType({
    "world": lambda names: tuple(names),
    "data": lambda names: ("dp", "sep"),
    "stage": lambda names: tuple(d for d in names if d != "pp"),
    "replica": lambda names: tuple(d for d in names if d not in ("pp", "dp")),
})


def mesh_of(dims):
    """The ProcessMesh of a ParallelDims, or `dims` itself (a plan applied by hand to a mesh)."""
    return dims.mesh if isinstance(dims, ParallelDims) else dims


def dims_of(mesh):
    """The ParallelDims of `mesh` (or of the global mesh), made on first use and kept in runtime.installed
    (its groups are made when built or first read); a ParallelDims is returned as it is."""
    if isinstance(mesh, ParallelDims):
        return mesh
    mesh = resolve_mesh(mesh)
    key = (tuple(mesh.process_ids), tuple(mesh.shape), tuple(mesh.dim_names))
    made = runtime.installed.parallel_dims
    if key not in made:
        made[key] = ParallelDims(mesh)
    return made[key]


@dataclass(frozen=True)
class Peer:
    """The other rank of a two-rank group, for point-to-point transfers."""

    peer: int
    group: object


def line_subgroups(mesh, dim, position_sets):
    """For each tuple of positions along mesh dim `dim`: this rank's group over those positions of its
    line (the ranks sharing its other coordinates), or None when this rank is not among them.
    Every rank must call this with the same sets in the same order (groups are made for every line)."""
    ensure_initialized()
    require_launched_ranks(mesh)
    axis = mesh.dim_names.index(find_dim(mesh, dim))
    lines = _slices(np.asarray(mesh.mesh), [axis])
    me = dist.get_rank()
    mine = {}
    for positions in position_sets:
        key = (tuple(mesh.process_ids), tuple(mesh.shape), ("line", axis, tuple(positions)))
        if key not in runtime.installed.groups:
            found = None
            for line in lines:
                ranks = tuple(line[i] for i in positions)
                group = _new_group(ranks)
                if me in ranks:
                    found = MeshGroup(ranks, ranks.index(me), group, kind=repr(key))
            runtime.installed.groups[key] = found
        mine[tuple(positions)] = runtime.installed.groups[key]
    return mine


def needs_pair_groups(size):
    """Gloo tags point-to-point messages with a per-group counter, so in one group
    a message only meets its receive when the two ranks alternate along every
    cycle of the exchange: true for all shifts of a power-of-two ring, false
    for some shift of any other size. Those get a group per pair of ranks."""
    return size > 1 and size & (size - 1) != 0


def _new_group(ranks):
    """Paddle's group over `ranks`, made once per set of ranks: the slices of dims that differ only by dims of
    size 1 (dp1 x sep2's data group and its sep group) are one group, so its rendezvous runs once."""
    members = tuple(sorted(ranks))
    if members == tuple(range(dist.get_world_size())):
        return None  # Paddle's default group: no new gloo rendezvous
    groups = runtime.installed.process_groups
    if members not in groups:
        groups[members] = _rendezvous(members)
    return groups[members]


def _rendezvous(ranks):
    with startup_guard("new_group", ranks):  # a rendezvous: waits for every member
        with _own_store(ranks):
            group = dist.new_group(list(ranks))
    # every rank leaves each group's creation together: the next rendezvous waits only for itself
    with startup_guard("new_group_barrier", range(dist.get_world_size())):
        dist.barrier()
    return group


@contextmanager
def _own_store(ranks):
    """On gloo, new_group's rendezvous on a store of the group's own. ProcessGroupGloo's constructor connects
    its members under the unprefixed keys "0".."size-1" of the store it is given, which every group shares with
    the world group's (never deleted, 952 bytes each on 8 ranks): a member that reads a peer's key before the
    peer rewrote it gets an earlier group's addresses ("sizeof(impl_) == bytes.size(). 136 vs 317" from the
    world's, "Connection refused" from a gone pair). A fresh TCPStore per group, served by its first member
    on a free port published in the default store under a key of this group alone, has no stale keys."""
    number = runtime.installed.group_rendezvous  # every rank counts every rendezvous, member or not
    runtime.installed.group_rendezvous += 1
    me = dist.get_rank()
    if paddle.get_device() != "cpu" or me not in ranks:  # NCCL's keys carry the group id; non-members skip
        yield
        return
    default = dist.collective._default_store
    key, root = f"paddle_cp/group_store/{number}", min(ranks)
    if me == root:  # serving before publishing its address: no member's connect retries (3 s each)
        host = dist.ParallelEnv().current_endpoint.split(":")[0]
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        store = _tcp_store(host, port, True)
        default.set(key, f"{host}:{port}".encode())
    else:
        default.wait(key)
        host, port = bytes(default.get(key)).decode().rsplit(":", 1)
        store = _tcp_store(host, int(port), False)
    dist.collective._default_store = store
    try:
        yield
    finally:
        dist.collective._default_store = default


def _tcp_store(host, port, serve):
    # 0 workers: the server waits for none at start (new_group's rendezvous waits for the members);
    # 900 s: Paddle's own store timeout
    return paddle.base.core.TCPStore(host, port, serve, 0, 900)


def _create_groups(slices):
    rank = dist.get_rank()
    mine = None
    for ranks in slices:
        group = _new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = MeshGroup(ranks, ranks.index(rank), group)
    return mine


def _create_pairs(slices, mine):
    me = mine.ranks[mine.index]
    for ranks in slices:
        for a, b in itertools.combinations(ranks, 2):
            group = _rendezvous((a, b))  # its own: gloo's point-to-point tags count per group
            if me in (a, b):
                mine.pairs[frozenset((a, b))] = group


__all__ = ["set_mesh", "get_mesh", "resolve_mesh", "require_launched_ranks", "find_dim", "require_dim", "dim_size", "mesh_group", "fold_groups", "split_dim_groups", "line_subgroups", "MeshGroup", "ParallelDims", "dims_of", "Peer"]
