"""Pipeline parallel (`pp_config`): stages from `split_spec`, schedules, their runner."""
from __future__ import annotations

from .. import mesh as mesh_lib
from .loss_factor import LossFactorAgreement
from .ownership import holders, keep_own_parameters, place_on_stages
from .runner import Pipeline, recompute_boundary
from .settings import check_settings
from .stages import SplitPoint, build_stage_plan


def plan_pipeline(model, mesh, pp_config):
    """(settings, StagePlan): everything checked, no collective yet."""
    settings = check_settings(pp_config)
    mesh_lib.require_dim(mesh, "pp", "pp_config")
    stages = mesh_lib.dim_size(mesh, "pp")
    return settings, build_stage_plan(model, settings.split_spec, settings.global_spec, stages, settings.vpp_degree)


def apply_pipeline(model, mesh, settings, plan):
    """Keep this rank's stage: place every parameter on its stages (freeing the rest), run the model's
    forward as a pipeline. Collective (groups are made)."""
    pp_group = mesh_lib.mesh_group(mesh, ["pp"])
    stage, p = pp_group.index, plan.stages
    neighbours = sorted({tuple(sorted((s, (s + 1) % p))) for s in range(p - (plan.chunks == 1))})
    pairs = mesh_lib.line_subgroups(mesh, "pp", neighbours)
    peers = {}
    for positions, group in pairs.items():
        if group is not None:
            other = [r for r in group.ranks if r != group.ranks[group.index]][0]
            peers[positions[0] if positions[1] == stage else positions[1]] = mesh_lib.Peer(other, group.group)
    place_on_stages(mesh, holders(model, plan), pp_group)
    Pipeline(model, plan, settings, stage, peers, pp_group)


def step_timeline(model):
    """This rank's actions in the model's last scheduled step: [(kind, virtual stage, micro-batch, start, end)],
    kind one of F, B, SEND_F, RECV_F, SEND_B, RECV_B; times from time.time() (comparable across local ranks)."""
    pipeline = model.__dict__.get("_pcp_pipeline")
    if pipeline is None:
        raise ValueError("step_timeline needs a model parallelized with pp_config")
    return list(pipeline.timeline)


__all__ = ["SplitPoint", "LossFactorAgreement", "plan_pipeline", "apply_pipeline", "keep_own_parameters", "step_timeline",
           "recompute_boundary"]
