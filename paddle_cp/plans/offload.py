"""OffloadRecomputeInputs: what a recomputed layer saves for its backward waits in host memory."""
from __future__ import annotations

from ..activations.host_offload import checkpoints_of, offload_recompute_inputs
from ..activations.recompute_settings import recompute_setting
from ..mesh import mesh_of
from .base import Plan, refuse_param_plan


class OffloadRecomputeInputs(Plan):
    """`{"model.layers.*": OffloadRecomputeInputs()}`: the inputs each recompute call of these layers saves
    (hidden states, rotary tables) are copied to host memory after its forward and brought back for its
    backward replay, the next layer's ahead of time (activations/host_offload.py). Needs recomputation of
    these layers (PaddleFormers' recompute_granularity="full"); a forward that records a graph without it
    raises. One store serves every layer the key matches: `self.store` counts bytes and copies (kept in
    runtime, keyed by this plan: runtime.reset() empties it)."""

    must_match = True

    @property
    def store(self):
        return checkpoints_of(self)

    def check(self, layer, mesh, param_names=()):
        refuse_param_plan(self, param_names)
        setting = recompute_setting(layer)
        if setting is not None and not setting.whole_layers:
            raise ValueError(f"OffloadRecomputeInputs on {type(layer).__name__}: its model does not recompute whole "
                             f"layers ({setting.current}), so nothing waits for a replay to offload; set "
                             f"{setting.turn_on}, or drop the plan")

    def apply(self, layer, dims, param_names=()):
        self.check(layer, mesh_of(dims), param_names)
        return offload_recompute_inputs(layer, self)
