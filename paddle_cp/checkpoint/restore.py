"""Put single-card values from a checkpoint into the current run's local tensors.

Every rank reads the boxes it needs straight from the files (one machine or a
shared filesystem), only their byte ranges, so loading issues no collective:
whatever mesh, plans or sharding level saved the checkpoint, each rank reads
just its own slices.
"""
from __future__ import annotations

import contextlib

import numpy as np
import paddle

from ..params import store_local_value
from . import layout
from .format import global_spec, optimizer_key


def expected_model_specs(model):
    """{key: (global shape, dtype)} the current model needs."""
    return {key: (layout.global_shape(value), layout.dtype_name(value.dtype))
            for key, value in model.state_dict().items()}


def expected_optimizer_specs(model, optimizer):
    """{key: (global shape, dtype)} of the optimizer state (accumulators, master weights) for `model`."""
    specs = {}
    for key, param in model.named_parameters():
        for name in layout.state_names(optimizer, param):
            shape = (1,) if name in layout.SCALAR_ACCUMULATORS else layout.global_shape(param)
            specs[optimizer_key(key, name)] = (shape, layout.dtype_name(layout.state_dtype(optimizer, param, name)))
    return specs


def restore_model(model, reader):
    for key, tensor in model.state_dict().items():
        # lazy or not (a lazy parameter counts as initialized afterwards), held here or not
        value = layout.local_value(tensor, lambda offset, shape: reader.region(key, offset, shape))
        if value is not None and value.dtype == np.float32 and tensor.dtype in layout.LOW_PRECISION:  # api.CASTS
            value = paddle.to_tensor(value).astype(tensor.dtype)
        store_local_value(tensor, value)


def restore_optimizer(model, optimizer, reader, model_reader):
    """Create the optimizer's state where it is missing (a fresh optimizer: accumulators and, with
    multi_precision, master weights; in host memory under dp_config offload_optimizer) and fill it. A master
    weight the checkpoint lacks (saved by an fp32 run, or without multi_precision) is, where the checkpoint
    holds the parameter in float32 (`model_reader`), its values exactly, not their rounding to the model's
    bfloat16/float16; a parameter saved in bfloat16/float16 keeps the fp32 copy of the loaded parameter."""
    inner = layout.inner_optimizer(optimizer)
    saved = reader.metadata.state_dict_metadata
    first = layout.accumulator_names(optimizer)[0]
    mine = [(key, p) for key, p in model.named_parameters()
            if layout.steps_here(p) and optimizer_key(key, first) in saved]
    missing = [p for _, p in mine if any(layout.state_tensor(optimizer, p, n) is None
                                         for n in layout.state_names(optimizer, p))]
    host = getattr(optimizer, "host_optimizer", None)
    if missing and host is not None:
        host.create_state(missing)
    elif missing:
        inner._create_accumulators(paddle.static.default_main_program().global_block(), missing)
    # set_value from numpy writes on the current place: under offload, host memory (not the device's)
    with host.on_host() if host is not None else contextlib.nullcontext():
        for key, param in mine:
            for name in layout.state_names(optimizer, param):
                state_key = optimizer_key(key, name)
                if name == layout.MASTER_WEIGHT and state_key not in saved:
                    if not _saved_in_float32(model_reader, key):
                        continue  # saved in the model's dtype (or elsewhere): keep the copy of the parameter just created
                    value = layout.local_value(param, lambda offset, shape: model_reader.region(key, offset, shape))
                elif name in layout.SCALAR_ACCUMULATORS:
                    value = reader.full(state_key)
                else:
                    value = layout.local_value(param, lambda offset, shape: reader.region(state_key, offset, shape))
                layout.state_tensor(optimizer, param, name).set_value(value)
    if host is not None:
        host.rehome()


def _saved_in_float32(model_reader, key):
    """Whether the checkpoint holds parameter `key` in float32 (api.CASTS: an fp32 run's checkpoint)."""
    return key in model_reader.metadata.state_dict_metadata and global_spec(model_reader.metadata, key)[1] == "float32"
