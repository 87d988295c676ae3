"""Plans keyed on one parameter (`"...q_proj.lora_B": ColWiseParallel()`): accepted only where the
layer's forward, which sees local tensors, stays exact.

Paddle splits the named parameter and reshards whatever its consumers need. Here the
layer's own forward multiplies local tensors, so a split parameter must fit the split
its layer's plan makes:
- a `bias` keyed ColWise on a layer whose weight is ColWise: split so already;
- the factors of a LoRA linear (PaddleFormers' LoRALinear:
  `out = x @ W + b + dropout(x) @ lora_A @ lora_B * scaling`, lora_A [in, r], lora_B [r, out]):
  * layer ColWise (W's columns split, x whole): lora_B ColWise (columns split), lora_A whole.
    The branch's output columns are this rank's, like the base output's. lora_A's gradient
    only sees this rank's columns: it is summed over `mp`.
  * layer RowWise (W's rows split, x this rank's slice): lora_A RowWise (rows split), lora_B
    whole. The branch is a partial sum, summed over `mp` with the base output by RowWise's
    hook. lora_B's gradient only sees this rank's rows: it is summed over `mp`.
  * layer without a tensor-parallel plan: both factors whole.
A factor the plan leaves out under a ColWise / RowWise layer (Paddle's sequence-parallel
LoRA plans name no factor) is given the split above (`implied_lora_plans`): Paddle keeps it
whole and reshards, which gives the same numbers, and a checkpoint holds the same global
tensor. Everything else is refused, naming the fix.
"""
from __future__ import annotations

import paddle

from ..plans.tensor_parallel import ColWiseParallel, RowWiseParallel

LORA_FACTORS = ("lora_A", "lora_B")
# the split each factor needs (None: whole), and the factor whose gradient is partial over mp, by layer plan
LORA_LAYOUT = {
    ColWiseParallel: ({"lora_A": None, "lora_B": 1}, "lora_A"),
    RowWiseParallel: ({"lora_A": 0, "lora_B": None}, "lora_B"),
    None: ({"lora_A": None, "lora_B": None}, None),
}
WHAT_IT_DOES = {ColWiseParallel: "keeps this rank's output columns", RowWiseParallel: "sums row slices over mp"}


def _is_lora_linear(layer):
    """Whether `layer` computes x @ W + x @ lora_A @ lora_B (W [in, out], lora_A [in, r], lora_B [r, out])."""
    weight, factors = getattr(layer, "weight", None), [getattr(layer, f, None) for f in LORA_FACTORS]
    if not all(isinstance(t, paddle.Tensor) and t.ndim == 2 for t in [weight, *factors]):
        return False
    (fan_in, fan_out), (a_in, rank), (b_rank, b_out) = weight.shape, *(f.shape for f in factors)
    return (a_in, b_rank, b_out) == (fan_in, rank, fan_out)


class _LayerPlans:
    """One layer's tensor-parallel plan (ColWise, RowWise or None) and its parameter splits {name: axis}."""

    def __init__(self, name, layer):
        self.name, self.layer, self.kind, self.splits = name, layer, None, {}

    def add(self, plan, param_names):
        kind = type(plan)
        if kind not in (ColWiseParallel, RowWiseParallel):
            return
        if plan.on_whole_layer(param_names):
            if self.kind not in (None, kind):
                raise ValueError(f"{self.name} has both ColWiseParallel and RowWiseParallel: give it one")
            self.kind = kind
            return
        for param in param_names:
            axis = plan.param_axis(self.layer, param)
            if self.splits.setdefault(param, axis) != axis:
                raise ValueError(f"{self.name}.{param} is planned to split on dims {self.splits[param]} and "
                                 f"{axis}: give it one plan")

    def check(self):
        """The parameters whose gradients are partial over mp; raises if the forward cannot be exact."""
        if _is_lora_linear(self.layer):
            return self._check_lora()
        for param, axis in self.splits.items():
            if not (param == "bias" and self.kind is ColWiseParallel):
                raise ValueError(
                    f"plan key {self.name}.{param}: paddle_cp keeps local tensors, so it must know how "
                    f"{type(self.layer).__name__}'s forward uses a split {param}; it knows a layer's weight "
                    "and bias (key the layer) and the lora_A / lora_B of a LoRA linear. Plan the layer instead, "
                    f"or leave {param} whole")
        return []

    def _check_lora(self):
        wanted, partial = LORA_LAYOUT[self.kind]
        layer_plan = self.kind.__name__ if self.kind else "no tensor-parallel plan"
        others = sorted(set(self.splits) - set(LORA_FACTORS) - ({"bias"} if self.kind is ColWiseParallel else set()))
        if others:
            raise ValueError(f"plan key {self.name}.{others[0]}: on a LoRA linear only lora_A / lora_B (and the "
                             "layer) can be planned")
        for factor, axis in wanted.items():
            got = self.splits.get(factor)
            if got == axis:
                continue
            if axis is None:
                raise ValueError(f"{self.name} has {layer_plan}, so its {factor} must stay whole (split on dim "
                                 f"{got}, the LoRA branch would no longer match the base output): remove the plan "
                                 f"key '{self.name}.{factor}'")
            raise ValueError(f"{self.name} has {layer_plan}, which {WHAT_IT_DOES[self.kind]}; its {factor} must be "
                             f"split on dim {axis} to match, not {got}: key '{self.name}.{factor}' with "
                             f"{layer_plan}()")
        return [getattr(self.layer, partial)] if partial else []


def _by_layer(matched):
    layers = {}
    for name, layer, plans, param_names in matched:
        entry = layers.setdefault(id(layer), _LayerPlans(name, layer))
        for plan in plans:
            entry.add(plan, param_names)
    return layers.values()


def implied_lora_plans(matched):
    """Entries like resolve_plan's for the LoRA factor each ColWise / RowWise LoRA linear needs split and
    the plan does not name (lora_B on columns, lora_A on rows)."""
    implied = []
    for entry in _by_layer(matched):
        if entry.kind is not None and _is_lora_linear(entry.layer):
            for factor, axis in LORA_LAYOUT[entry.kind][0].items():
                if axis is not None and factor not in entry.splits:
                    implied.append((entry.name, entry.layer, [entry.kind()], [factor]))
    return implied


def check_parameter_plans(matched):
    """Parameters whose gradients are partial over mp, for `matched` (resolve_plan's list with the implied
    LoRA plans); raises on a parameter plan the layer's forward cannot honour exactly, before anything changes."""
    partial = []
    for entry in _by_layer(matched):
        if entry.splits or _is_lora_linear(entry.layer):
            partial += entry.check()
    return partial
