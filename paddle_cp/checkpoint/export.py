"""`export_pretrained(model, directory, max_shard_size)`: the single-card weights as PaddleFormers'
`save_pretrained` writes them (Hugging Face names and layouts from the mapping its library's weight
format gives, checkpoint/weight_formats.py; sharded safetensors `model-0000i-of-0000N.safetensors` with
`model.safetensors.index.json`, config.json), for `ModelClass.from_pretrained(directory)`. Collective.

No rank holds the model: the output tensors are produced one at a time, each from the full values
of the parameters it is made of (gathered by every rank, `full_state.full_value`), and rank 0
streams it into its file (`safetensors_writer`), so a rank holds at most a parameter and the
tensor made from it on top of its share, whatever `max_shard_size` is.

A LoRA wrapper (PaddleFormers' `LoRAModel`: the format's adapter) exports its adapter as its
`save_pretrained(directory, save_checkpoint_format="unified")` writes it on one card (only the trained
lora_A / lora_B are gathered), for `LoRAModel.from_pretrained(model, directory)`; with `merge_lora=True`, the wrapped
model with the adapter merged into its weights, for its class's `from_pretrained` (merging needs each
weight beside its factors: rank 0 then holds the whole wrapped model's state).
"""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine

from ..libraries import load_integrations
from . import layout, restore
from .agree import count_failures
from .full_state import full_state_dict, full_value
from .pretrained import SAFE_INDEX, delivered_dtype, postprocess, whole_desc, whole_descs
from .safetensors_writer import StreamingFile, nbytes
from .weight_formats import adapter_of, format_of


def _check(model, directory, max_shard_size, merge_lora):
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise TypeError(f"export_pretrained(model, directory) takes a directory path, got {directory!r}")
    load_integrations(model)  # its library's weight format
    weight_format = format_of(model)
    if weight_format is None:
        raise TypeError(f"export_pretrained needs a PaddleFormers PretrainedModel (with .config and "
                        f".save_pretrained), got {type(model).__name__}: save a plain Layer with "
                        "pcp.save_checkpoint")
    if os.path.isfile(directory):
        raise ValueError(f"export directory {directory} is a file: pass a directory path")
    if not isinstance(merge_lora, bool):
        raise TypeError(f"merge_lora must be True or False, got {merge_lora!r}")
    if merge_lora and adapter_of(model) is None:
        raise TypeError(f"merge_lora=True needs a PaddleFormers LoRAModel, got {type(model).__name__}: "
                        "export it without merge_lora")
    try:
        limit = weight_format.shard_size(max_shard_size)
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"max_shard_size must be a number of bytes or a size like '5GB', got {max_shard_size!r}") from exc
    if not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    return limit


def _outputs(model):
    """[(file key, shape, dtype, engine)] of what save_pretrained writes, from the model's global specs."""
    engine = AOAEngine(format_of(model).saving(model), whole_descs(restore.expected_model_specs(model)), None)
    return engine, [(key, tuple(var.shape), delivered_dtype(var)) for key, var in sorted(engine.output_vars.items())
                    if var is not None]


def shard_files(outputs, limit):
    """[[entries of file 1], ...]: save_pretrained's rule, a new file once the next tensor would pass the limit."""
    files, current, size = [], [], 0
    for entry in outputs:
        tensor_size = nbytes(entry[1], entry[2])
        if current and size + tensor_size > limit:
            files.append(current)
            current, size = [], 0
        current.append(entry)
        size += tensor_size
    return files + [current] if current else files


def _make(engine, key, shape, dtype, state):
    """One output tensor from the full values of its sources, each gathered once (collective)."""
    out, full, full_key = None, None, None
    entries = engine.find_shard_sources(whole_desc(key, shape, dtype))
    for entry in sorted(entries, key=lambda e: e.source_slice.key):  # a fused q|k|v: many slices of one source
        source, target = entry.source_slice, entry.target_slice
        if source.key != full_key:
            full, full_key = None, source.key  # the previous source is freed before the next is gathered
            full = full_value(state[source.key])
        block = postprocess(full[tuple(slice(o, o + n) for o, n in zip(source.global_offset, source.local_shape))],
                            entry.postprocess_list)
        if out is None:
            out = np.empty(shape, dtype=block.dtype)  # the mapping's cast (save_pretrained's bfloat16 router)
        out[tuple(slice(o, o + n) for o, n in zip(target.global_offset, target.local_shape))] = block
    return out


def _write_config(model, directory):
    """config.json (and generation_config.json) as save_pretrained writes them."""
    config = copy.deepcopy(getattr(model, "config_to_save", model.config))
    config.dtype = layout.dtype_name(next(iter(model.parameters())).dtype)
    if not config.architectures:
        config.architectures = [type(model).__name__]
    config.tensor_model_parallel_size = 1
    config.save_pretrained(directory)
    cls = type(model)
    if cls.can_generate(cls):  # asked of the class: the instance's repr would print level-3 placeholders
        model.generation_config.save_pretrained(directory)


def _clear(directory):
    """Weights of an earlier save there would mix with these (save_pretrained clears them too)."""
    for name in os.listdir(directory):
        if name.endswith(".safetensors") or name == SAFE_INDEX:
            os.remove(os.path.join(directory, name))


def _export_lora(model, adapter, directory, merge_lora):
    """A LoRA wrapper's adapter, or with `merge_lora` the merged wrapped model, written by rank 0."""
    if merge_lora:
        values = full_state_dict(model)
    else:  # only what LoRA trains
        trained = {adapter.prefix + name for name, value in model.model.state_dict().items()
                   if not value.stop_gradient}
        values = {key: full_value(value) for key, value in model.state_dict().items() if key in trained}
    error = None
    if dist.get_rank() == 0:
        tensors = {key: paddle.to_tensor(np.ascontiguousarray(value)) for key, value in values.items()}
        try:
            if merge_lora:
                target, tensors = adapter.merged(model, tensors)
                # the state_dict path of save_pretrained (its flex-checkpoint path saves the local shards and is
                # collective)
                target.save_pretrained(directory, state_dict=tensors, safe_serialization=True,
                                       save_checkpoint_format="unified")
            else:
                adapter.save(model, tensors, directory)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait for rank 0
            error = exc
    return error


def export_pretrained(model, directory, max_shard_size="10GB", merge_lora=False):
    limit = _check(model, directory, max_shard_size, merge_lora)
    adapter = adapter_of(model)
    if adapter is not None:
        _raise_if_failed(_export_lora(model, adapter, directory, merge_lora), directory)
        return
    engine, outputs = _outputs(model)
    files = shard_files(outputs, limit)
    writer = dist.get_rank() == 0
    state, error, weight_map = model.state_dict(), None, {}
    if writer:
        try:
            os.makedirs(directory, exist_ok=True)
            _clear(directory)
        except OSError as exc:
            error = exc
    for number, entries in enumerate(files, start=1):
        name = f"model-{number:05d}-of-{len(files):05d}.safetensors"
        stream = None
        if writer and error is None:
            try:
                stream = StreamingFile(os.path.join(directory, name), entries)
            except OSError as exc:
                error = exc
        for key, shape, dtype in entries:
            value = _make(engine, key, shape, dtype, state)  # every rank: the gathers are collective
            if stream is not None and error is None:
                try:
                    stream.write(key, value)
                    weight_map[key] = name
                except (OSError, ValueError) as exc:  # keep gathering with the others, write no more
                    error = exc
                    stream.close()
            del value
    if writer and error is None:
        try:
            total = sum(nbytes(shape, dtype) for _, shape, dtype in outputs)
            with open(os.path.join(directory, SAFE_INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=4)
            _write_config(model, directory)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait for rank 0
            error = exc
    _raise_if_failed(error, directory)


def _raise_if_failed(error, directory):
    """Every rank returns once the files exist, or raises the same error."""
    if count_failures(layout.world_group(), error is None, "export_written"):
        raise RuntimeError(f"export_pretrained to {directory} failed on rank 0 (the cause is chained there)") from error
