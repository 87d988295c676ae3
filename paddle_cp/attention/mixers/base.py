"""What a token mixer is to ContextParallel: a kind of layer that mixes tokens along the sequence,
recognised by what the layer is, checked before any collective and attached to the layer.

A mixer is stateless: which layer it is attached to under which plan is in runtime.installed (a layer is
attached once: the hooks and wrappers it installs must not stack).
"""
from __future__ import annotations

from ... import runtime


class TokenMixer:
    """Subclass, then `paddle_cp.register_mixer(YourMixer())`: ContextParallel routes every layer your
    `claims` accepts (the planned layer or a sublayer), and parallelize refuses a claimed layer that no
    ContextParallel plan covers while the plan splits the sequence."""

    name = "token mixer"  # what such a layer is, in messages
    routable = True  # False: it mixes tokens, but paddle_cp has no context-parallel form of it

    def claims(self, layer):
        """Whether `layer` is of this mixer's kind."""
        raise NotImplementedError

    def check(self, layer, layout):
        """Raise ValueError naming the fix if `layer` cannot run in `layout` (a SequenceLayout); no collective."""

    def attach(self, layer, plan):
        """Run `layer`'s mixing under `plan` (a ContextParallel's SepRun: its layout and groups) from now on."""
        runs = runtime.installed.mixer_runs.setdefault(layer, {})
        attached = runs.get(self)
        if attached is plan:
            return
        if attached is not None:
            raise ValueError(f"{type(layer).__name__} ({layer.full_name()}) is covered by two ContextParallel plans: "
                             "key ContextParallel on one of its enclosing layers only")
        runs[self] = plan
        self._route(layer, plan)

    def _route(self, layer, plan):
        raise NotImplementedError
