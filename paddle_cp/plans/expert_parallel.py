"""ExpertParallel: a MoE block's routed experts split over an expert group (keyed in ep_config)."""
from __future__ import annotations

from dataclasses import dataclass

from .. import mesh as mesh_lib
from ..experts.blocks import check_block, find_moe_block, known_blocks
from ..experts.layout import ExpertLayout
from ..experts.local import HeldExperts
from ..experts.router_statistics import gather_router_logits
from ..params import DATA_DIMS, Partial, hold_parameter, mark_fetch_unit, record_of, shard_parameter
from .base import Plan, refuse_param_plan


@dataclass(frozen=True)
class ExpertFold:
    """What ep_config says about the expert groups: `degree` consecutive ranks of the mesh restricted to
    `dims` (row-major); whether the router logits feed a loss and are gathered over dp x sep."""

    degree: int
    dims: tuple
    gather_router_logits: bool = False


class ExpertParallel(Plan):
    """The routed experts of a MoE block (router, routed experts, any shared experts) split over the expert
    group: each rank holds a contiguous range of them; the block's tokens go to their experts' owners and
    back by all-to-all (experts/dispatch.py). Router, shared experts and attention run as without it.
    Keyed in `ep_config`, whose `degree` sizes the group:
    `{"degree": E, "parallelize_plan": {"model.layers.*.mlp": ExpertParallel()}}`."""

    def __init__(self):
        self._fold = None

    def folded(self, fold):
        """This plan with ep_config's groups (the front door binds them; the user's object is left alone)."""
        bound = ExpertParallel()
        bound._fold = fold
        return bound

    def check(self, layer, mesh, param_names=()):
        refuse_param_plan(self, param_names)
        if self._fold is None:
            raise ValueError("ExpertParallel belongs in ep_config: config['ep_config'] = {'degree': E, "
                             "'parallelize_plan': {'model.layers.*.mlp': ExpertParallel()}}")
        block = find_moe_block(layer)
        if block is None:
            raise ValueError(f"ExpertParallel applies to a MoE block ({', '.join(known_blocks())}), "
                             f"not to a {type(layer).__name__}")
        check_block(type(layer).__name__, block)
        ExpertLayout(block.num_experts, self._fold.degree)

    def groups_needed(self, layer, mesh):
        fold = (("fold", tuple(self._fold.dims), self._fold.degree),)
        # the data dims the fold leaves out: placement completion averages the experts over them
        folded = {mesh_lib.find_dim(mesh, d) for d in self._fold.dims}
        rest = tuple(d for d in (mesh_lib.find_dim(mesh, d) for d in DATA_DIMS) if d is not None and d not in folded)
        completion = (("group", rest),) if rest else ()
        return fold + completion + ((("pairs", "data"),) if self._gathers_router_logits(layer) else ())

    def _gathers_router_logits(self, layer):
        return self._fold.gather_router_logits and find_moe_block(layer).kind.router_output

    def apply(self, layer, dims, param_names=()):
        self.check(layer, mesh_lib.mesh_of(dims), param_names)
        dims = mesh_lib.dims_of(dims)
        block = find_moe_block(layer)
        group, replicas = dims.fold(self._fold.dims, self._fold.degree)
        held = HeldExperts(block, ExpertLayout(block.num_experts, group.size), group)
        _place_experts(block, held, replicas)
        held.install()
        if self._gathers_router_logits(layer):
            return gather_router_logits(layer, dims.with_pairs("data"))
        return None


def _place_experts(block, held, replicas):
    """Each rank keeps only its experts: listed ones held by their owner's position of the expert group,
    stacked tensors sharded along the expert dim (uneven ranges, as ExpertLayout cuts them); both averaged
    over `replicas`, the ranks holding the same experts (HeldExperts' gradients are its sources' mean)."""
    mark_fetch_unit(block.experts)  # which experts run, on how many rows, depends on the routing
    if block.listed:
        for expert, layer in enumerate(block.experts):
            owner = held.layout.owner(expert)
            for param in layer.parameters():
                hold_parameter(param, held.group, (owner,))
                record_of(param).place(Partial(replicas, "avg"))
        return
    for _, param in block.stacked_parameters():
        shard_parameter(param, 0, held.group, allow_uneven=True)
        record_of(param).place(Partial(replicas, "avg"))
