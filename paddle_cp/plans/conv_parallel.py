"""ConvParallel: a Conv2D computed with its input split along the width over `mp` (Paddle's spatial parallelism).

What the layer receives: the full input, on every mp rank (as for any replicated layer); each
rank keeps its W/mp columns (no communication), borrows the halo columns its kernel
reaches into from its neighbours (comm/halo.py), convolves, and drops the output
columns the halo produced. What its consumer gets: the full output, gathered over mp.
Paddle keeps the output as a DistTensor sharded on W and reshards it for whatever
consumes it; local tensors carry no placement, so the output is gathered, which is
what Paddle's resharding hands any consumer (values and gradients are one card's).

The weight and bias stay whole on every rank; their gradients are partial (each rank
saw only its columns) and are summed over mp by the optimizer parallelize returns
(`ParamRecord.mark_partial`, as for layers in a sequence-parallel region).

Paddle's conditions (`ConvParallel._is_supported`), with two gaps of Paddle's closed:
dilation 1 along W; without W padding the stride equals the kernel width and divides
each rank's part (Paddle checks the whole width, so a window could straddle two
ranks); with W padding the stride is 1 and the padding is "same" (left + right =
kernel - 1, so the output has the input's width; Paddle trims padding[1] columns on
each side, which is exact only then); every rank's part is as wide as the halo.
Paddle skips an unsupported layer silently; here it is a ValueError naming the fix.
"""
from __future__ import annotations

from typing import NamedTuple

import paddle

from .. import mesh as mesh_lib
from ..comm.autograd import gather_replicated, split_to_group
from ..comm.halo import exchange_halo
from ..params import record_of
from .base import Plan, refuse_param_plan
from .hook_args import map_first_input

WIDTH_AXIS = {"NCHW": 3, "NHWC": 2}


class WidthGeometry(NamedTuple):
    """A Conv2D along its input's width: where W is, and how its window moves over it."""

    axis: int     # W's axis in the input and the output
    kernel: int
    stride: int
    left: int     # zero padding before the first column
    right: int    # and after the last

    @property
    def halo(self):
        """(columns borrowed from the left neighbour, from the right one): the padding of a 'same' conv."""
        return self.left, self.right


def width_geometry(layer):
    """The layer's WidthGeometry; a ValueError naming the fix when ConvParallel cannot split it."""
    name = type(layer).__name__
    if not isinstance(layer, paddle.nn.Conv2D):
        raise ValueError(f"ConvParallel applies to a paddle.nn.Conv2D, got {name}: key the plan by a Conv2D's name")
    data_format = layer._data_format
    if data_format not in WIDTH_AXIS:
        raise ValueError(f"ConvParallel: data_format {data_format!r} is not supported: use 'NCHW' or 'NHWC'")
    if layer._padding_mode != "zeros":
        raise ValueError(f"ConvParallel: padding_mode={layer._padding_mode!r} is not supported: "
                         "use padding_mode='zeros' (or pad the input before the layer)")
    if layer._dilation[1] != 1:
        raise ValueError(f"ConvParallel: dilation along W must be 1, got {layer._dilation[1]}: use dilation 1 on W "
                         "or leave this layer out of the plan")
    kernel, stride = layer._kernel_size[1], layer._stride[1]
    left, right = _width_padding(layer, kernel, stride)
    geometry = WidthGeometry(WIDTH_AXIS[data_format], kernel, stride, left, right)
    if left == right == 0:
        if stride != kernel:
            raise ValueError(f"ConvParallel: without W padding the W stride must equal the kernel width (windows "
                             f"that do not overlap), got stride {stride}, kernel {kernel}: set stride={kernel} on W "
                             f"or pad W by {(kernel - 1) // 2} ('same')")
    elif stride != 1 or left + right != kernel - 1:
        raise ValueError(f"ConvParallel: with W padding the W stride must be 1 and the padding 'same' (left + right "
                         f"= kernel width - 1 = {kernel - 1}), got stride {stride}, padding ({left}, {right}): "
                         f"use stride 1 and padding {(kernel - 1) // 2} on W")
    return geometry


def _width_padding(layer, kernel, stride):
    """(left, right) zero padding along W, as the conv op resolves the layer's padding argument."""
    algorithm, padding = layer._padding_algorithm, layer._updated_padding
    if algorithm == "VALID":
        return 0, 0
    if algorithm == "SAME":  # the op pads max((ceil(W/s) - 1) * s + k - W, 0), the smaller half first
        if stride == 1:
            return (kernel - 1) // 2, kernel - 1 - (kernel - 1) // 2
        return 0, 0  # stride == kernel is required then, and W % stride == 0 leaves nothing to pad
    return (padding[1], padding[1]) if len(padding) == 2 else (padding[2], padding[3])  # [h, w] or [t, b, l, r]


def check_input_width(geometry, width, mp):
    """The conditions on the input's width (known at the first forward); the same on every mp rank."""
    if width % mp:
        raise ValueError(f"ConvParallel: input width {width} is not divisible by mp={mp}: "
                         "pad or crop the width to a multiple of mp")
    part = width // mp
    if geometry.halo == (0, 0) and part % geometry.stride:
        raise ValueError(f"ConvParallel: each rank's {part} columns (width {width} / mp={mp}) must be a multiple of "
                         f"the W stride {geometry.stride}, so no window straddles two ranks: make the width a "
                         f"multiple of {mp * geometry.stride}")
    if part < max(geometry.halo):
        raise ValueError(f"ConvParallel: each rank's {part} columns (width {width} / mp={mp}) are fewer than the "
                         f"{max(geometry.halo)} halo columns a neighbour needs: use a smaller mp or a wider input")


class ConvParallel(Plan):
    """Split a Conv2D's input along its width over `mp`; exchange the halo; gather the output."""

    def check(self, layer, mesh, param_names=()):
        refuse_param_plan(self, param_names)
        mesh_lib.require_dim(mesh, "mp", "ConvParallel")
        width_geometry(layer)

    def groups_needed(self, layer, mesh):
        return (("pairs", "mp"),)

    def apply(self, layer, dims, param_names=()):
        self.check(layer, mesh_lib.mesh_of(dims), param_names)
        geometry = width_geometry(layer)
        group = mesh_lib.dims_of(dims).with_pairs("mp")
        if group.size == 1:
            return None
        for param in (layer.weight, layer.bias):
            if param is not None:
                record_of(param).mark_partial(group)  # this rank's columns give part of the gradient
        axis, (left, right) = geometry.axis, geometry.halo

        def widened_part(x):
            if x.ndim != 4:
                raise ValueError(f"ConvParallel: a Conv2D input must be 4-D ({layer._data_format}), got {x.ndim}-D")
            check_input_width(geometry, x.shape[axis], group.size)
            # [.., W, ..] -> [.., W/mp, ..] -> [.., left + W/mp + right, ..]
            return exchange_halo(split_to_group(x, group, axis), group, axis, left, right)

        def before(layer, args, kwargs):
            return map_first_input(args, kwargs, widened_part)

        def after(layer, inputs, output):
            # the layer padded the widened part again: drop the columns its halo produced, then gather
            width = output.shape[axis]
            own = paddle.slice(output, [axis], [left], [width - right])  # [.., W/mp (/stride), ..]
            return gather_replicated(own, group, axis)  # [.., W_out, ..]

        layer.register_forward_pre_hook(before, with_kwargs=True)
        return layer.register_forward_post_hook(after)
