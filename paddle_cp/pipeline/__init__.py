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


def _neighbours(plan):
    """The stage pairs that send activations and gradients to each other (a ring when virtual stages wrap)."""
    p = plan.stages
    return sorted({tuple(sorted((s, (s + 1) % p))) for s in range(p - (plan.chunks == 1))})


def pipeline_groups_needed(model, plan):
    """The groups `apply_pipeline` uses (ParallelDims.build's needs): pp, a pair group per neighbouring stages,
    a group per set of several stages holding one parameter."""
    holder_sets = {stages for _, stages in holders(model, plan).values() if len(stages) > 1}
    return (("group", "pp"),) + tuple(("line", "pp", positions) for positions in {*_neighbours(plan), *holder_sets})


def apply_pipeline(model, dims, settings, plan):
    """Keep this rank's stage: place every parameter on its stages (freeing the rest), run the model's
    forward as a pipeline. The groups from `dims` (a mesh.ParallelDims)."""
    pp_group = dims.pp
    stage = pp_group.index
    peers = {}
    for positions in _neighbours(plan):
        group = dims.line("pp", positions)
        if group is not None:
            other = [r for r in group.ranks if r != group.ranks[group.index]][0]
            peers[positions[0] if positions[1] == stage else positions[1]] = mesh_lib.Peer(other, group.group)
    place_on_stages(dims, holders(model, plan), pp_group)
    Pipeline(model, plan, settings, stage, peers, pp_group)


def step_timeline(model):
    """This rank's actions in the model's last scheduled step: [(kind, virtual stage, micro-batch, start, end)],
    kind one of F, B, SEND_F, RECV_F, SEND_B, RECV_B; times from time.time() (comparable across local ranks)."""
    pipeline = model.__dict__.get("_pcp_pipeline")
    if pipeline is None:
        raise ValueError("step_timeline needs a model parallelized with pp_config")
    return list(pipeline.timeline)


__all__ = ["SplitPoint", "LossFactorAgreement", "plan_pipeline", "pipeline_groups_needed", "apply_pipeline",
           "keep_own_parameters", "step_timeline", "recompute_boundary"]
