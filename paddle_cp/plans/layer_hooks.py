"""User hooks as plans: `fn(process_mesh=mesh)` returns the hook to register."""
from __future__ import annotations

from .. import runtime
from ..mesh import mesh_of
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
        """Call the user's factory now, so a bad hook fails before parallelize changes anything."""
        refuse_param_plan(self, param_names)
        hook = self.fn(process_mesh=mesh)
        if not callable(hook):
            raise TypeError(f"{type(self).__name__}: fn(process_mesh=...) must return a hook "
                            f"(a callable), got {type(hook).__name__}")
        runtime.state.resolved_hooks.setdefault(layer, {})[self] = (mesh, hook)

    def apply(self, layer, dims, param_names=()):
        mesh = mesh_of(dims)
        resolved = runtime.state.resolved_hooks
        checked_mesh, _ = resolved.get(layer, {}).get(self, (None, None))
        if checked_mesh is not mesh:  # applied directly, not after parallelize's check
            self.check(layer, mesh, param_names)
        _, hook = resolved[layer].pop(self)
        return self._register(layer, hook)


class PrepareLayerInput(_UserHook):
    """Register `fn(process_mesh=mesh)` as a forward pre-hook `(layer, inputs) -> inputs or None`."""

    def _register(self, layer, hook):
        return layer.register_forward_pre_hook(hook, prepend=True)


class PrepareLayerOutput(_UserHook):
    """Register `fn(process_mesh=mesh)` as a forward post-hook `(layer, inputs, output) -> output or None`."""

    def _register(self, layer, hook):
        return layer.register_forward_post_hook(hook)
