"""What the whole plan says about single layers, worked out and checked before anything changes.

Paddle keeps global shapes and reshards whatever a consumer needs; with local
tensors a ColWise output stays split only when a sibling layer is RowWise
(q/k/v -> o, gate/up -> down), a fused weight (qkv, gate_up) is split per part
as its model library's registered rule says (register_fused_weights), else by its name,
and the parent of split attention projections must reshape by its local head
counts (its per-head norms then see this rank's heads: their gradients are summed). Plans keyed on a single parameter (LoRA factors) must fit their layer's
plan, and some make gradients partial over `mp` (parameter_plans.py). `annotate_plan`
derives all of that and raises on anything that cannot work; `PlanAnnotation.apply`
then writes it onto the layers and parameter records.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import paddle

from .. import mesh as mesh_lib
from ..attention.mixers import SoftmaxAttention, mixer_of
from ..params import record_of
from ..plans.column_info import ColumnInfo, set_column_info
from ..plans.tensor_parallel import ColWiseParallel, RowWiseParallel
from ..runtime import installed
from .plan_keys import plan_key
from .parameter_plans import check_parameter_plans

HEAD_COUNT_ATTRS = ("num_heads", "num_key_value_heads", "num_attention_heads", "num_kv_heads")
SPLIT_AXIS = {ColWiseParallel: 1, RowWiseParallel: 0}  # which weight axis each plan splits


@dataclass
class PlanAnnotation:
    columns: list = field(default_factory=list)      # (layer, ColumnInfo) of every ColWise layer
    head_counts: list = field(default_factory=list)  # (layer, attribute, local value)
    partial_gradients: list = field(default_factory=list)  # parameters whose gradients are summed over mp

    def groups_needed(self):
        """The groups `apply` uses (ParallelDims.build's needs)."""
        return (("group", "mp"),) if self.partial_gradients else ()

    def apply(self, dims):
        """Write it onto the layers and records (the mp group from `dims`, a ParallelDims)."""
        for layer, info in self.columns:
            set_column_info(layer, info)
        for layer, attr, value in self.head_counts:
            setattr(layer, attr, value)
        if self.partial_gradients:
            group = dims.mp
            for param in self.partial_gradients:
                record_of(param).mark_partial(group)


def _parent(name):
    return name.rpartition(".")[0]


def register_fused_weights(factory):
    """How a model library's fused projections split: `factory(model)` returns, for a model of its library (None
    for another's), `parts(name, layer, parent)`: the column sizes of the fused weight of ColWise layer `name`
    (q | k | v, gate | up), each split on its own, or None where the weight splits plainly. The first factory
    taking the model decides; a model none takes gets `fused_parts_by_name`. PaddleFormers' rule is
    registered by its integration (paddle_cp/integrations/)."""
    if not callable(factory):
        raise TypeError(f"register_fused_weights takes a factory model -> parts(name, layer, parent), got {factory!r}")
    if factory not in installed.fused_weight_rules:
        installed.fused_weight_rules.append(factory)


def fused_parts_by_name(name, layer, parent):
    """Fused projections by their names (Paddle's intermediate-API example model's): `gate_up_proj` /
    `up_gate_proj` are gate | up halves, a `qkv_proj` is q | k | v, sized by its parent's head counts; None for
    any other weight (split plainly)."""
    leaf = name.rpartition(".")[2]
    out = layer.weight.shape[1]
    if "gate" in leaf and "up" in leaf:
        return (out // 2, out // 2)
    if "qkv" not in leaf:
        return None
    heads = getattr(parent, "num_heads", None) or getattr(parent, "num_attention_heads", None)
    kv_heads = getattr(parent, "num_key_value_heads", None) or getattr(parent, "num_kv_heads", None) or heads
    head_dim = getattr(parent, "head_dim", None)
    if not (heads and head_dim) or (heads + 2 * kv_heads) * head_dim != out:
        raise ValueError(f"ColWiseParallel on fused projection {name!r}: cannot tell its q/k/v sizes (its parent "
                         "needs num_heads, num_key_value_heads and head_dim matching the weight); split it into "
                         "q_proj/k_proj/v_proj or leave it unplanned")
    return (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)


def _check_parts(name, parts, size):
    for part in parts:
        if part % size:
            raise ValueError(f"ColWiseParallel on {name!r}: part of size {part} is not divisible by mp={size}: "
                             "choose an mp degree that divides it")


def _layer_plans(matched):
    """`matched` with only the plans that act on a whole layer (not on one parameter other than its weight)."""
    entries = []
    for name, layer, plans, params in matched:
        plans = [p for p in plans if not isinstance(p, (ColWiseParallel, RowWiseParallel)) or p.on_whole_layer(params)]
        if plans:
            entries.append((name, layer, plans, params))
    return entries


def annotate_plan(model, matched, mesh):
    """The annotation of `matched` (resolve_plan's list) on `mesh`; raises, changing nothing, if it cannot work."""
    partial_gradients = check_parameter_plans(matched)
    _check_no_split_inside_mixers(model, matched)
    matched = _layer_plans(matched)
    layers = dict(model.named_sublayers())
    row_parents = {_parent(name) for name, _, plans, _ in matched  # RowWise layers that take split inputs
                   if any(isinstance(p, RowWiseParallel) and p.is_input_parallel for p in plans)}
    size = mesh_lib.dim_size(mesh, "mp")
    annotation, split_parents = PlanAnnotation(partial_gradients=partial_gradients), []
    parts_of = next((rule for factory in installed.fused_weight_rules if (rule := factory(model)) is not None),
                    fused_parts_by_name)
    for name, layer, plans, _ in matched:
        weight = getattr(layer, "weight", None)
        if not any(isinstance(p, ColWiseParallel) for p in plans) or not isinstance(weight, paddle.Tensor):
            continue
        feeds_row = _parent(name) in row_parents
        parts = parts_of(name, layer, layers.get(_parent(name), model))
        if parts and weight.ndim == 2:
            _check_parts(name, parts, size)
        annotation.columns.append((layer, ColumnInfo(feeds_row, parts)))
        if feeds_row and _parent(name) not in split_parents:
            split_parents.append(_parent(name))
    planned = {id(layer) for _, layer, plans, _ in matched if any(isinstance(p, tuple(SPLIT_AXIS)) for p in plans)}
    for parent_name in split_parents:
        parent = layers.get(parent_name, model)
        annotation.head_counts += _local_head_counts(parent_name, parent, size)
        annotation.partial_gradients += _per_head_parameters(parent, planned)
    _check_shared_weights(model, matched)
    return annotation


def _check_no_split_inside_mixers(model, matched):
    """A projection split inside a token mixer other than softmax attention (Qwen3-Next's Gated DeltaNet: its fused
    in_proj_qkvz / in_proj_ba grouped by k-head, its conv1d over the q|k|v channels, its per-head A_log, dt_bias
    and norm) would feed that mixer a rank's columns laid out as nothing it reshapes by: refused."""
    layers = dict(model.named_sublayers(include_self=True))
    for name, _, plans, _ in matched:
        if not any(isinstance(p, tuple(SPLIT_AXIS)) for p in plans):
            continue
        parts = name.split(".")
        for owner in (".".join(parts[:i]) for i in range(len(parts), 0, -1)):
            mixer = mixer_of(layers[owner]) if owner in layers else None
            if mixer is not None and not isinstance(mixer, SoftmaxAttention):
                raise ValueError(f"tensor parallel plan on {name!r} inside {owner!r} ({mixer.name}): splitting its "
                                 f"projections is not supported; leave '{plan_key(owner)}' and its sublayers "
                                 "unplanned in mp_config (whole on every mp rank, as the Trainer's plans keep it)")


def _local_head_counts(name, layer, size):
    counts = []
    for attr in HEAD_COUNT_ATTRS:
        value = getattr(layer, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % size:
                raise ValueError(f"{name}.{attr} = {value} is not divisible by mp={size}: "
                                 "choose an mp degree that divides the head counts")
            counts.append((layer, attr, value // size))
    return counts


def _per_head_parameters(parent, planned):
    """Parameters of the attention `parent` that act on each of its heads alike (1-D, head_dim long: the
    q/k norms of Qwen3, Gemma3, Qwen3-MoE): with the heads split, this rank's gradient covers its own heads
    only, so it is summed over mp."""
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int):
        return []
    return [param for layer in parent.sublayers() if id(layer) not in planned
            for param in layer._parameters.values()
            if param is not None and param.ndim == 1 and param.shape[0] == head_dim]


def _split_axes(matched):
    """{id(weight): {axis: layer name}} of every weight a tensor-parallel plan splits."""
    axes = {}
    for name, layer, plans, _ in matched:
        weight = getattr(layer, "weight", None)
        for plan in plans:
            axis = SPLIT_AXIS.get(type(plan))
            if axis is not None and isinstance(weight, paddle.Tensor):
                axes.setdefault(id(weight), {}).setdefault(axis, name)
    return axes


def _check_shared_weights(model, matched):
    """A split weight shared with an unplanned layer (tied embeddings) would reach it split; one
    shared by layers that split it on different axes cannot be both."""
    axes = _split_axes(matched)
    for by_axis in axes.values():
        if len(by_axis) > 1:
            (a, first), (b, second) = sorted(by_axis.items())
            raise ValueError(f"{first}.weight and {second}.weight are one tensor split on different axes ({a} and "
                             f"{b}): untie them or plan both layers alike")
    planned = {id(layer) for _, layer, plans, _ in matched
               if any(isinstance(p, (ColWiseParallel, RowWiseParallel)) for p in plans)}
    holders = {}
    for name, layer in model.named_sublayers(include_self=True):
        for param in layer._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append((name, layer))
    for name, layer, plans, _ in matched:
        weight = getattr(layer, "weight", None)
        if id(layer) not in planned or not isinstance(weight, paddle.Tensor):
            continue
        for other_name, other in holders.get(id(weight), []):
            if id(other) not in planned:
                raise ValueError(f"{name}.weight is shared with {other_name or 'the model'}, which has no "
                                 f"tensor-parallel plan: plan it too (e.g. '{other_name}.weight': "
                                 "ColWiseParallel()) or untie the weights")
