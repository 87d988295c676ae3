"""User hooks as plans: `fn(process_mesh=mesh)` returns the hook to register."""
from __future__ import annotations

from .base import Plan, refuse_param_plan


class _UserHook(Plan):
    """Applied after the layer's tensor and context plans, with its pre-hook first and its
    post-hook last among theirs: like Paddle's hooks on global tensors, it sees the whole
    input and the summed or gathered output, whatever the order of the plan list."""

    order = 1

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError(f"{type(self).__name__} needs a callable fn(process_mesh) returning a hook, "
                            f"got {type(fn).__name__}")
        self.fn = fn

    def check(self, layer, mesh, param_names=()):
        refuse_param_plan(self, param_names)

    def apply(self, layer, mesh, param_names=()):
        self.check(layer, mesh, param_names)
        hook = self.fn(process_mesh=mesh)
        if not callable(hook):
            raise TypeError(f"{type(self).__name__}: fn(process_mesh=...) must return a hook, got {type(hook).__name__}")
        return self._register(layer, hook)


class PrepareLayerInput(_UserHook):
    """Register `fn(process_mesh=mesh)` as a forward pre-hook `(layer, inputs) -> inputs or None`."""

    def _register(self, layer, hook):
        return layer.register_forward_pre_hook(hook, prepend=True)


class PrepareLayerOutput(_UserHook):
    """Register `fn(process_mesh=mesh)` as a forward post-hook `(layer, inputs, output) -> output or None`."""

    def _register(self, layer, hook):
        return layer.register_forward_post_hook(hook)
