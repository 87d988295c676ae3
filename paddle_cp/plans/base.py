"""What every parallel plan is: validated arguments, then `apply(layer, dims, param_names)`."""


class Plan:
    # parallelize applies a layer's plans by this rank, stably: tensor and context plans (0),
    # then user hooks (1), which then see whole tensors, then sequence plans (2), which wrap all.
    order = 0

    def check(self, layer, mesh, param_names=()):
        """Raise on a bad target before parallelize runs any collective."""

    def groups_needed(self, layer, mesh):
        """The process groups `apply` will read from ParallelDims (ParallelDims.build's needs, e.g.
        ("group", "mp")): parallelize makes what the run declares, in one order, before any plan applies."""
        return ()

    def apply(self, layer, dims, param_names=()):
        """Install the plan on `layer`, with the groups of `dims` (mesh.ParallelDims; a ProcessMesh when
        applied by hand)."""
        raise NotImplementedError

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


def refuse_param_plan(plan, param_names):
    if param_names:
        raise ValueError(
            f"{type(plan).__name__} applies to a whole layer, not to parameter(s) {list(param_names)}: "
            "key it by the layer's name"
        )
