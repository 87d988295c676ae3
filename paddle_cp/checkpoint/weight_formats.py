"""How a model library names and lays out its models' weights in the files its `save_pretrained` writes: the
seam through which export_pretrained and load_pretrained read another library's files (PaddleFormers' rules are
registered by its integration, paddle_cp/integrations/).

A format's name maps are AOA configs (Paddle's flex-checkpoint mapping language): `loading(model)` the one
from_pretrained applies to the files' tensors, `saving(model)` the one save_pretrained applies to the model's.
A model no format claims keeps its own names and layouts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..runtime import installed

PLAIN = {"aoa_statements": []}  # names and layouts as the model holds them


@dataclass(frozen=True)
class AdapterFormat:
    """A library's LoRA wrapper: its files hold only the trained factors, or the wrapped model merged."""

    is_adapter: Callable        # model -> is it a LoRA wrapper
    prefix: str                 # the wrapper's name for the wrapped model's parameters ("model.")
    save: Callable              # (wrapper, {name: whole tensor} of its trained factors, directory): write them
    merged: Callable            # (wrapper, {name: whole tensor}) -> (wrapped model, its merged state dict)


@dataclass(frozen=True)
class WeightFormat:
    claims: Callable            # model -> is it a model of this library
    loading: Callable           # model -> the AOA config from_pretrained applies
    saving: Callable            # model -> the AOA config save_pretrained applies
    shard_size: Callable        # max_shard_size (bytes, or a size like "5GB") -> bytes; ValueError if neither
    adapter: Optional[AdapterFormat] = None


def register_weight_format(weight_format):
    """Read and write the files of `weight_format`'s library (a WeightFormat) from now on."""
    if not isinstance(weight_format, WeightFormat):
        raise TypeError(f"register_weight_format takes a WeightFormat, got {type(weight_format).__name__}")
    if weight_format not in installed.weight_formats:
        installed.weight_formats.append(weight_format)


def format_of(model):
    """The registered format claiming `model`, or None."""
    return next((f for f in installed.weight_formats if f.claims(model)), None)


def adapter_of(model):
    """The adapter format `model` is a LoRA wrapper of, or None."""
    weight_format = format_of(model)
    adapter = weight_format.adapter if weight_format is not None else None
    return adapter if adapter is not None and adapter.is_adapter(model) else None


def loading_mapping(model):
    """The AOA config from_pretrained applies for `model` (PLAIN when no format claims it)."""
    weight_format = format_of(model)
    return weight_format.loading(model) if weight_format is not None else PLAIN
