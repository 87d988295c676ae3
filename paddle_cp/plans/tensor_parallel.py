"""Tensor-parallel plans over the `mp` mesh dim: every rank keeps a slice of a weight.

Paddle Linear weights are [in, out]. ColWiseParallel keeps a slice of the out
columns (and of the bias); RowWiseParallel a slice of the in rows, its partial
outputs summed over `mp`. Paddle keeps global shapes and reshards whatever a
consumer needs; here a ColWise output stays split only when a sibling layer is
RowWise (q/k/v -> o, gate/up -> down): any other consumer (embedding users, the
loss after lm_head) gets it gathered. plan_annotation.py works that out from the
whole plan before the plans are applied and gives each ColWise layer its ColumnInfo.

A plan keyed on one parameter other than `weight` (`"...q_proj.lora_B": ColWiseParallel()`)
splits that parameter only, where Paddle places it (`param_axis`), and adds no hook:
api/parameter_plans.py accepts it only where the layer's own plan keeps its forward exact.
"""
from __future__ import annotations

import paddle

from .. import mesh as mesh_lib
from ..comm.autograd import copy_to_group, gather_replicated, reduce_from_group, split_to_group
from ..params import shard_parameter
from .base import Plan
from .column_info import column_info
from .hook_args import first_tensor, map_first_input, replace_first

def _mp_group(plan, dims):
    mesh_lib.require_dim(mesh_lib.mesh_of(dims), "mp", type(plan).__name__)
    return mesh_lib.dims_of(dims).mp


class _TensorParallel(Plan):
    """What ColWise and RowWise share: Paddle's placement of a parameter named by the plan key."""

    AXIS_BY_RANK = {}  # a named parameter's split axis by its number of dims (Paddle's placements)

    def groups_needed(self, layer, mesh):
        return (("group", "mp"),)

    @staticmethod
    def on_whole_layer(param_names):
        """Whether the key names the layer (or its weight, which the layer's forward needs split the same
        way as the layer plan splits it) rather than another parameter."""
        return list(param_names) in ([], ["weight"])

    def param_axis(self, layer, name):
        """The axis Paddle splits parameter `name` of `layer` on when a plan key names it."""
        param = getattr(layer, name, None)
        if not isinstance(param, paddle.Tensor):
            raise ValueError(f"{type(self).__name__} keyed on {name!r}: {type(layer).__name__}.{name} is "
                             f"{type(param).__name__}, not a tensor; key a tensor attribute or the layer")
        if param.ndim not in self.AXIS_BY_RANK:
            ranks = " or ".join(f"{rank}-D" for rank in self.AXIS_BY_RANK)
            raise ValueError(f"{type(self).__name__} splits a {ranks} parameter; {type(layer).__name__}.{name} "
                             f"is {param.ndim}-D {list(param.shape)}: plan another parameter or the layer")
        return self.AXIS_BY_RANK[param.ndim]

    def _check_params(self, layer, mesh, param_names):
        mesh_lib.require_dim(mesh, "mp", type(self).__name__)
        size = mesh_lib.dim_size(mesh, "mp")
        for name in param_names:
            axis = self.param_axis(layer, name)
            length = getattr(layer, name).shape[axis]
            if length % size:
                raise ValueError(f"{type(self).__name__}: dim {axis} of {type(layer).__name__}.{name} (size "
                                 f"{length}) is not divisible by mp={size}: choose an mp degree that divides it")

    def _shard_params(self, layer, dims, param_names):
        self._check_params(layer, mesh_lib.mesh_of(dims), param_names)
        group = _mp_group(self, dims)
        for name in param_names:
            shard_parameter(getattr(layer, name), self.param_axis(layer, name), group)


class ColWiseParallel(_TensorParallel):
    """Split the weight's out dim (and the bias) over `mp`.

    The output stays split over `mp` when a sibling layer is RowWiseParallel and
    `gather_output` is False; otherwise it is gathered, as Paddle's resharding
    would give its consumer. On a layer that is not a Linear or Embedding the
    weight's dim 1 is split (as Paddle does); if that is the dim the layer
    contracts (e.g. an lm_head weight stored [vocab, hidden]), its input is split
    to match and the partial outputs summed. Keyed on another parameter: a 2-D one
    is split on dim 1, a 1-D one on dim 0.
    """

    AXIS_BY_RANK = {2: 1, 1: 0}

    def __init__(self, gather_output=False):
        if not isinstance(gather_output, bool):
            raise TypeError(f"gather_output must be a bool, got {type(gather_output).__name__}")
        self.gather_output = gather_output

    def check(self, layer, mesh, param_names=()):
        if not self.on_whole_layer(param_names):
            return self._check_params(layer, mesh, param_names)
        mesh_lib.require_dim(mesh, "mp", "ColWiseParallel")
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, paddle.Tensor) or weight.ndim != 2:
            raise ValueError(f"ColWiseParallel needs a layer with a 2-D weight, got {type(layer).__name__}")
        size = mesh_lib.dim_size(mesh, "mp")  # the parts of a fused weight are checked by annotate_plan
        if weight.shape[1] % size:
            raise ValueError(f"ColWiseParallel: {type(layer).__name__} out size {weight.shape[1]} is not divisible "
                             f"by mp={size}: choose an mp degree that divides it")

    def apply(self, layer, dims, param_names=()):
        if not self.on_whole_layer(param_names):
            return self._shard_params(layer, dims, param_names)
        self.check(layer, mesh_lib.mesh_of(dims), param_names)
        group = _mp_group(self, dims)
        info = column_info(layer)
        weight = shard_parameter(layer.weight, 1, group, info.parts)
        bias = getattr(layer, "bias", None)
        if isinstance(layer, paddle.nn.Linear) and bias is not None:
            shard_parameter(bias, 0, group, info.parts)  # a split output needs the matching bias slice
        if isinstance(layer, paddle.nn.Embedding):
            return layer.register_forward_post_hook(self._gathered(weight))
        contracts = False if isinstance(layer, paddle.nn.Linear) else None  # None: decided by the first input
        return self._register(layer, group, weight, info, contracts)

    def _gathered(self, shard):
        def gather(layer, inputs, output):
            output = gather_replicated(output, shard.group, output.ndim - 1)
            if len(shard.parts) > 1:
                output = paddle.index_select(output, paddle.to_tensor(shard.column_order()), axis=output.ndim - 1)
            return output
        return gather

    def _register(self, layer, group, weight, info, contracts):
        mode = {} if contracts is None else {"contracts": contracts}
        gather = self._gathered(weight)
        call = {}  # this call's input as given and as prepared (a layer handing its weight on needs the first)

        def prepare(x):
            if not mode:
                mode["contracts"] = _contracts_split_dim(layer, x.shape[-1], weight)
            call["given"] = x
            call["prepared"] = split_to_group(x, group, -1) if mode["contracts"] else copy_to_group(x, group)
            return call["prepared"]

        def before(layer, args, kwargs):
            call.clear()
            return map_first_input(args, kwargs, prepare)

        def finish(output):
            if mode["contracts"]:
                return reduce_from_group(output, group)
            if info.feeds_row_parallel and not self.gather_output:
                return output
            return gather(layer, None, output)

        def after(layer, inputs, output):
            given, prepared = call.pop("given", None), call.pop("prepared", None)
            if isinstance(output, (tuple, list)) and any(t is layer.weight for t in output):
                if getattr(layer, "bias", None) is not None and any(t is layer.bias for t in output):
                    raise ValueError(f"ColWiseParallel on {type(layer).__name__}: it hands its weight and bias on for "
                                     "the loss to apply (a fused head with chunked loss), and a split bias is not "
                                     "served: build the head without a bias, or leave it out of the mp plan")
                # the layer hands its weight on instead of applying it (PaddleFormers' fused lm_head for its
                # chunked loss): the consumer gets the whole weight and the input as given, and computes on
                # every rank what one card does (the weight's gradient: this rank's slice of it)
                return type(output)(gather(layer, None, t) if t is layer.weight else given if t is prepared else t
                                    for t in output)
            return replace_first(output, finish(first_tensor(output)))

        layer.register_forward_pre_hook(before, with_kwargs=True)
        return layer.register_forward_post_hook(after)


def _contracts_split_dim(layer, in_features, shard):
    """Whether a non-Linear layer multiplies its input by the weight's split dim 1
    (a weight stored [out, in], like an lm_head's [vocab, hidden])."""
    rows, cols = layer.weight.shape[0], sum(shard.parts)
    if in_features == cols and in_features != rows:
        if getattr(layer, "bias", None) is not None:
            raise ValueError(f"ColWiseParallel on {type(layer).__name__}: its weight is stored [out, in] and it has "
                             "a bias; use a paddle.nn.Linear ([in, out] weight)")
        return True
    if in_features == rows and in_features != cols:
        return False
    raise ValueError(f"ColWiseParallel on {type(layer).__name__}: cannot tell which dim of its {[rows, cols]} weight "
                     f"meets inputs of width {in_features}; use a paddle.nn.Linear ([in, out] weight)")


class RowWiseParallel(_TensorParallel):
    """Split the weight's in dim over `mp`; sum the partial outputs over `mp`, then add the bias once.

    `is_input_parallel=True`: the input is already this rank's slice (the output
    of a ColWise sibling); False: the full input is split first. Keyed on another
    parameter: a 2-D one is split on dim 0 (Paddle keeps a bias whole, so a key
    naming one is refused rather than applied to the weight).
    """

    AXIS_BY_RANK = {2: 0}

    def __init__(self, is_input_parallel=True):
        if not isinstance(is_input_parallel, bool):
            raise TypeError(f"is_input_parallel must be a bool, got {type(is_input_parallel).__name__}")
        self.is_input_parallel = is_input_parallel

    def check(self, layer, mesh, param_names=()):
        if not self.on_whole_layer(param_names):
            return self._check_params(layer, mesh, param_names)
        mesh_lib.require_dim(mesh, "mp", "RowWiseParallel")
        weight = getattr(layer, "weight", None)
        if not isinstance(layer, paddle.nn.Linear):
            raise ValueError(f"RowWiseParallel needs a paddle.nn.Linear ([in, out] weight), got {type(layer).__name__}")
        size = mesh_lib.dim_size(mesh, "mp")
        if weight.shape[0] % size:
            raise ValueError(f"RowWiseParallel: in size {weight.shape[0]} is not divisible by mp={size}")

    def apply(self, layer, dims, param_names=()):
        if not self.on_whole_layer(param_names):
            return self._shard_params(layer, dims, param_names)
        self.check(layer, mesh_lib.mesh_of(dims), param_names)
        group = _mp_group(self, dims)
        shard_parameter(layer.weight, 0, group)
        bias = {}

        def before(layer, args, kwargs):
            # every rank would add the bias: take it out, add it once after the sum
            if layer.bias is not None:
                bias["value"] = layer.bias
                layer._parameters["bias"] = None
            if self.is_input_parallel:
                return None
            return map_first_input(args, kwargs, lambda x: split_to_group(x, group, -1))

        def after(layer, inputs, output):
            output = reduce_from_group(output, group)
            return output + bias["value"] if "value" in bias else output

        def restore(layer, inputs, output):  # also when the forward raised: the layer keeps its bias
            if "value" in bias:
                layer._parameters["bias"] = bias.pop("value")

        layer.register_forward_pre_hook(before, with_kwargs=True)
        layer.register_forward_post_hook(after)
        return layer.register_forward_post_hook(restore, always_call=True)
