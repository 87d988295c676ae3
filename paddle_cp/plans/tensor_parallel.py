"""Tensor-parallel plans over the `mp` mesh dim: every rank keeps a slice of a weight.

Paddle Linear weights are [in, out]. ColWiseParallel keeps a slice of the out
columns (and of the bias); RowWiseParallel a slice of the in rows, its partial
outputs summed over `mp`. Paddle keeps global shapes and reshards whatever a
consumer needs; here a ColWise output stays split only when a sibling layer is
RowWise (q/k/v -> o, gate/up -> down): any other consumer (embedding users, the
loss after lm_head) gets it gathered. `annotate_plan` works that out from the
whole plan before the plans are applied.
"""
from __future__ import annotations

from dataclasses import dataclass

import paddle

from .. import mesh as mesh_lib
from ..comm.autograd import copy_to_group, gather_replicated, reduce_from_group, split_to_group
from ..params import shard_parameter
from .base import Plan

HEAD_COUNT_ATTRS = ("num_heads", "num_key_value_heads", "num_attention_heads", "num_kv_heads")


def map_first_input(args, kwargs, fn):
    """(args, kwargs) with `fn` applied to the layer's main input: the first positional
    argument, or the first Tensor keyword argument (models often call `layer(hidden_states=x)`)."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    for key, value in kwargs.items():
        if isinstance(value, paddle.Tensor):
            return args, {**kwargs, key: fn(value)}
    raise ValueError("this plan's layer was called without a Tensor input")


def first_tensor(inputs):
    return inputs[0] if isinstance(inputs, (tuple, list)) else inputs


def replace_first(inputs, value):
    if isinstance(inputs, (tuple, list)):
        return (value, *inputs[1:])
    return value


def _mp_group(plan, mesh):
    mesh_lib.require_dim(mesh, "mp", type(plan).__name__)
    return mesh_lib.mesh_group(mesh, ["mp"])


class ColWiseParallel(Plan):
    """Split the weight's out dim (and the bias) over `mp`.

    The output stays split over `mp` when a sibling layer is RowWiseParallel and
    `gather_output` is False; otherwise it is gathered, as Paddle's resharding
    would give its consumer. On a layer that is not a Linear or Embedding the
    weight's dim 1 is split (as Paddle does); if that is the dim the layer
    contracts (e.g. an lm_head weight stored [vocab, hidden]), its input is split
    to match and the partial outputs summed.
    """

    def __init__(self, gather_output=False):
        if not isinstance(gather_output, bool):
            raise TypeError(f"gather_output must be a bool, got {type(gather_output).__name__}")
        self.gather_output = gather_output

    def check(self, layer, mesh, param_names=()):
        mesh_lib.require_dim(mesh, "mp", "ColWiseParallel")
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, paddle.Tensor) or weight.ndim != 2:
            raise ValueError(f"ColWiseParallel needs a layer with a 2-D weight, got {type(layer).__name__}")
        info = getattr(layer, "pcp_column", None)
        parts = info.parts if info else None
        size = mesh_lib.dim_size(mesh, "mp")
        for part in parts or (weight.shape[1],):
            if part % size:
                raise ValueError(f"ColWiseParallel: {type(layer).__name__} out size {part} is not divisible by "
                                 f"mp={size}: choose an mp degree that divides it")

    def apply(self, layer, mesh, param_names=()):
        self.check(layer, mesh, param_names)
        group = _mp_group(self, mesh)
        info = getattr(layer, "pcp_column", None) or ColumnInfo()
        weight = shard_parameter(layer.weight, 1, group, info.parts)
        bias = getattr(layer, "bias", None)
        if isinstance(layer, paddle.nn.Linear) and bias is not None:
            shard_parameter(bias, 0, group, info.parts)  # a split output needs the matching bias slice
        if isinstance(layer, paddle.nn.Embedding):
            return layer.register_forward_post_hook(self._gathered(weight))
        contracts = False if isinstance(layer, paddle.nn.Linear) else None  # None: decided by the first input
        return self._register(layer, group, weight, info, contracts)

    def _gathered(self, record):
        def gather(layer, inputs, output):
            output = gather_replicated(output, record.mp_group, output.ndim - 1)
            if len(record.parts) > 1:
                output = paddle.index_select(output, paddle.to_tensor(record.column_order()), axis=output.ndim - 1)
            return output
        return gather

    def _register(self, layer, group, weight, info, contracts):
        mode = {} if contracts is None else {"contracts": contracts}
        gather = self._gathered(weight)

        def prepare(x):
            if not mode:
                mode["contracts"] = _contracts_split_dim(layer, x.shape[-1], weight)
            return split_to_group(x, group, -1) if mode["contracts"] else copy_to_group(x, group)

        def before(layer, args, kwargs):
            return map_first_input(args, kwargs, prepare)

        def after(layer, inputs, output):
            if mode["contracts"]:
                return reduce_from_group(output, group)
            if info.feeds_row_parallel and not self.gather_output:
                return output
            return gather(layer, inputs, output)

        layer.register_forward_pre_hook(before, with_kwargs=True)
        return layer.register_forward_post_hook(after)


def _contracts_split_dim(layer, in_features, record):
    """Whether a non-Linear layer multiplies its input by the weight's split dim 1
    (a weight stored [out, in], like an lm_head's [vocab, hidden])."""
    rows, cols = layer.weight.shape[0], sum(record.parts)
    if in_features == cols and in_features != rows:
        if getattr(layer, "bias", None) is not None:
            raise ValueError(f"ColWiseParallel on {type(layer).__name__}: its weight is stored [out, in] and it has "
                             "a bias; use a paddle.nn.Linear ([in, out] weight)")
        return True
    if in_features == rows and in_features != cols:
        return False
    raise ValueError(f"ColWiseParallel on {type(layer).__name__}: cannot tell which dim of its {[rows, cols]} weight "
                     f"meets inputs of width {in_features}; use a paddle.nn.Linear ([in, out] weight)")


class RowWiseParallel(Plan):
    """Split the weight's in dim over `mp`; sum the partial outputs over `mp`, then add the bias once.

    `is_input_parallel=True`: the input is already this rank's slice (the output
    of a ColWise sibling); False: the full input is split first.
    """

    def __init__(self, is_input_parallel=True):
        if not isinstance(is_input_parallel, bool):
            raise TypeError(f"is_input_parallel must be a bool, got {type(is_input_parallel).__name__}")
        self.is_input_parallel = is_input_parallel

    def check(self, layer, mesh, param_names=()):
        mesh_lib.require_dim(mesh, "mp", "RowWiseParallel")
        weight = getattr(layer, "weight", None)
        if not isinstance(layer, paddle.nn.Linear):
            raise ValueError(f"RowWiseParallel needs a paddle.nn.Linear ([in, out] weight), got {type(layer).__name__}")
        size = mesh_lib.dim_size(mesh, "mp")
        if weight.shape[0] % size:
            raise ValueError(f"RowWiseParallel: in size {weight.shape[0]} is not divisible by mp={size}")

    def apply(self, layer, mesh, param_names=()):
        self.check(layer, mesh, param_names)
        group = _mp_group(self, mesh)
        shard_parameter(layer.weight, 0, group)
        bias = {}

        def before(layer, args, kwargs):
            # every rank would add the bias: take it out, add it once after the sum
            bias["value"] = layer.bias
            if layer.bias is not None:
                layer._parameters["bias"] = None
            if self.is_input_parallel:
                return None
            return map_first_input(args, kwargs, lambda x: split_to_group(x, group, -1))

        def after(layer, inputs, output):
            output = reduce_from_group(output, group)
            value = bias.pop("value")
            if value is not None:
                layer._parameters["bias"] = value
                output = output + value
            return output

        layer.register_forward_pre_hook(before, with_kwargs=True)
        return layer.register_forward_post_hook(after)


@dataclass(frozen=True)
class ColumnInfo:
    """What the whole plan says about one ColWise layer."""

    feeds_row_parallel: bool = False
    parts: tuple = None


def _parent(name):
    return name.rpartition(".")[0]


def _fused_parts(name, layer, parent):
    """Column sizes of a fused projection, by its name; None for a plain one."""
    leaf = name.rpartition(".")[2]
    out = layer.weight.shape[1]
    if "gate" in leaf and "up" in leaf:
        return (out // 2, out // 2)
    if "qkv" in leaf:
        heads = getattr(parent, "num_heads", None) or getattr(parent, "num_attention_heads", None)
        kv_heads = getattr(parent, "num_key_value_heads", None) or getattr(parent, "num_kv_heads", None) or heads
        head_dim = getattr(parent, "head_dim", None)
        if not (heads and head_dim) or (heads + 2 * kv_heads) * head_dim != out:
            raise ValueError(f"ColWiseParallel on fused projection {name!r}: cannot tell its q/k/v sizes (its parent "
                             "needs num_heads, num_key_value_heads and head_dim matching the weight); split it into "
                             "q_proj/k_proj/v_proj or leave it unplanned")
        return (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    return None


def annotate_plan(model, matched, mesh):
    """Before plans apply: tell each ColWise layer whether a RowWise sibling consumes its
    split output and how a fused weight is laid out; give the parents of split
    attention projections their local head counts (model code that reshapes by
    `num_heads` then sees this rank's heads)."""
    layers = dict(model.named_sublayers())
    row_parents = {_parent(name) for name, _, plans, _ in matched  # RowWise layers that take split inputs
                   if any(isinstance(p, RowWiseParallel) and p.is_input_parallel for p in plans)}
    size = mesh_lib.dim_size(mesh, "mp")
    split_parents = set()
    for name, layer, plans, _ in matched:
        if not any(isinstance(p, ColWiseParallel) for p in plans) or not isinstance(getattr(layer, "weight", None), paddle.Tensor):
            continue
        parent = layers.get(_parent(name), model)
        feeds_row = _parent(name) in row_parents
        layer.pcp_column = ColumnInfo(feeds_row, _fused_parts(name, layer, parent))
        if feeds_row:
            split_parents.add(_parent(name))
    for parent_name in split_parents:
        _localize_head_counts(parent_name, layers.get(parent_name, model), size)
    _check_shared_weights(model, matched)


def _check_shared_weights(model, matched):
    """A split weight shared with an unplanned layer (tied embeddings) would reach it split."""
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


def _localize_head_counts(name, layer, size):
    for attr in HEAD_COUNT_ATTRS:
        value = getattr(layer, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % size:
                raise ValueError(f"{name}.{attr} = {value} is not divisible by mp={size}: "
                                 "choose an mp degree that divides the head counts")
            setattr(layer, attr, value // size)
