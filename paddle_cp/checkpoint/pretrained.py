"""`load_pretrained(model, directory)`: weights that PaddleFormers' `save_pretrained` wrote
(safetensors, one file or sharded with `model.safetensors.index.json`) into a parallelized model,
each rank reading only the slices it keeps.

The files hold Hugging Face names and layouts (Linear weights `[out, in]`, Phi3's q/k/v heads in
their own order); `from_pretrained` maps them onto the model with the model class's
`_gen_aoa_config` through Paddle's AOA engine. So does this (the mapping its library's registered
weight format gives, checkpoint/weight_formats.py): for each box of the single-card
tensor this rank holds (`params.local_boxes`: its tensor-parallel pieces, nothing on a level-3
non-owner or another pipeline stage), the engine names the file slices that fill it and the
transpose to apply; safetensors reads just those slices. Loading issues no collective except
one agreement on the checks, so no rank starts reading while another has found a problem.
"""
from __future__ import annotations

import ast
import json
import os

import numpy as np
import paddle
from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

from ..libraries import load_integrations
from ..params import store_local_value
from . import layout, restore
from .agree import count_failures
from .format import numpy_dtype
from .io_bytes import count
from .safetensors_writer import DTYPES
from .weight_formats import loading_mapping

SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
_REBUILD = "build the model from the config saved with the weights (ModelClass(AutoConfig.from_pretrained(directory)))"
# safetensors' dtype names -> Paddle's (what the AOA engine and the model's state_dict use)
_DTYPES = {safetensors: paddle_name for paddle_name, safetensors in DTYPES.items()}


def weight_files(directory):
    """{key: file path} of a save_pretrained directory; ValueError when there is none."""
    if not os.path.isdir(directory):
        raise ValueError(f"load_pretrained: {directory} is not a directory: pass the directory save_pretrained "
                         "(or pcp.export_pretrained) wrote")
    index = os.path.join(directory, SAFE_INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"load_pretrained: {index} is unreadable ({exc}): save the model again") from exc
        files = {key: os.path.join(directory, name) for key, name in weight_map.items()}
        absent = sorted({path for path in files.values() if not os.path.isfile(path)})
        if absent:
            raise ValueError(f"load_pretrained: {SAFE_INDEX} in {directory} lists files that are missing: "
                             f"{[os.path.basename(p) for p in absent[:3]]}; copy the whole directory")
        return files
    single = os.path.join(directory, SAFE_WEIGHTS)
    if not os.path.isfile(single):
        raise ValueError(f"load_pretrained: {directory} holds neither {SAFE_INDEX} nor {SAFE_WEIGHTS}: pass a "
                         "directory written by save_pretrained(..., safe_serialization=True) or export_pretrained")
    from safetensors import safe_open

    with safe_open(single, framework="numpy") as f:
        return {key: single for key in f.keys()}


class SafetensorsFiles:
    """The tensors of a save_pretrained directory, opened lazily: headers first, slices on demand."""

    def __init__(self, directory):
        from safetensors import safe_open

        self.files = weight_files(directory)
        self._open = {}
        self._safe_open = safe_open
        self.specs = {}  # key -> (shape, Paddle dtype name)
        for key, path in self.files.items():
            piece = self._handle(path).get_slice(key)
            self.specs[key] = (tuple(piece.get_shape()), _DTYPES.get(piece.get_dtype(), piece.get_dtype()))

    def _handle(self, path, framework="numpy"):
        if (path, framework) not in self._open:
            try:
                self._open[path, framework] = self._safe_open(path, framework=framework)
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise ValueError(f"load_pretrained: {path} is not a readable safetensors file ({exc}): "
                                 "save the model again") from exc
        return self._open[path, framework]

    def read(self, key, offset, shape):
        """The block of `key` at `offset` of size `shape` (numpy; bfloat16 as its uint16 bits, which is how
        Paddle takes it back): only its bytes are read."""
        bfloat16 = self.specs[key][1] == "bfloat16"  # numpy has no bfloat16: read through Paddle
        piece = self._handle(self.files[key], "paddle" if bfloat16 else "numpy").get_slice(key)
        block = piece[tuple(slice(o, o + n) for o, n in zip(offset, shape))] if shape else piece.get()
        block = block.numpy() if bfloat16 else block
        count("read", block.nbytes)
        return block

    def shard_info(self):
        """The files' tensors as the AOA engine's source description (each one whole shard)."""
        return whole_descs(self.specs)


def whole_desc(key, shape, dtype):
    """The AOA engine's description of a whole tensor."""
    return ShardedWeightDesc(key, tuple(shape), tuple(shape), (0,) * len(shape), dtype)


def whole_descs(specs):
    """{key: [whole_desc]} of tensors {key: (shape, dtype)}: the engine's description of unsharded tensors."""
    return {key: [whole_desc(key, shape, dtype)] for key, (shape, dtype) in specs.items()}


def _engine(files, specs, mapping, directory):
    """Paddle's AOA engine from the files to the model's keys, after checking they fit."""
    try:
        engine = AOAEngine(mapping, files.shard_info(), whole_descs(specs))
    except KeyError as exc:  # a model key no file tensor maps to
        raise ValueError(f"load_pretrained: {directory} does not fit this model: keys it lacks [{exc.args[0]!r}]; "
                         f"{_REBUILD}") from exc
    except Exception as exc:  # noqa: BLE001 - the engine asserts when statements name absent keys
        raise ValueError(f"load_pretrained: the files in {directory} do not fit {mapping.get('aoa_statements', [])[:2]}"
                         f"... (the model class's name mapping): {type(exc).__name__}: {exc}; load weights saved "
                         "from the same model class") from exc
    outputs = engine.output_vars
    missing = sorted(key for key in specs if outputs.get(key) is None)
    used = {source for key in specs if outputs.get(key) is not None for source, *_ in outputs[key].slices}
    # a file key nothing takes from (save_pretrained also writes a tied lm_head, which the model has)
    unexpected = sorted(key for key in files.specs if key not in used and key not in specs)
    if missing or unexpected:
        raise ValueError(f"load_pretrained: {directory} does not fit this model: keys it lacks {missing[:5]}, "
                         f"keys only in the files {unexpected[:5]}; {_REBUILD}")
    for key, (shape, dtype) in sorted(specs.items()):
        found = outputs[key]
        delivered = delivered_dtype(found)
        if tuple(found.shape) != tuple(shape) or delivered != dtype:
            raise ValueError(f"load_pretrained: {directory} holds '{key}' as {delivered}{list(found.shape)}, "
                             f"this model needs {dtype}{list(shape)}: build the model from the saved config, "
                             "with the dtype the weights were saved in")
    return engine


def delivered_dtype(found):
    """The dtype the engine delivers for a model key: its file dtype, or the cast the class's mapping declares
    (`dtype='float32'`: DeepSeek-V3 and GLM4-MoE save their router in bfloat16 and load it as float32)."""
    casts = {next((step for step in reversed(steps or ()) if not step.startswith("[")), found.dtype)
             for *_, steps in found.slices}
    return casts.pop() if len(casts) == 1 else found.dtype


def postprocess(block, steps):
    """Apply the engine's steps to a block (numpy; bfloat16 as its uint16 bits): transposes ("[1, 0]") and casts."""
    for step in steps or ():
        if step.startswith("["):
            block = np.transpose(block, ast.literal_eval(step))
        else:
            block = _cast(block, step)
    return block


def _cast(block, dtype):
    """`block` as Paddle dtype `dtype`; bfloat16 is uint16 bits on both sides (numpy has none), cast by Paddle."""
    bits = numpy_dtype("bfloat16")
    if block.dtype != bits and dtype != "bfloat16":
        return block.astype(dtype)
    source = paddle.to_tensor(block.view(np.int16)).view(paddle.bfloat16) if block.dtype == bits else \
        paddle.to_tensor(block)
    return source.astype(dtype).numpy()


def _read_box(files, engine, key, tensor, offset, shape):
    """The values of model key `key` in the box at `offset` of size `shape` of the single-card tensor, from
    the file slices the engine names (numpy)."""
    dtype = layout.dtype_name(tensor.dtype)
    out = np.empty(tuple(shape), dtype=numpy_dtype(dtype))
    desc = ShardedWeightDesc(key, tuple(shape), layout.global_shape(tensor), tuple(offset), dtype)
    for entry in engine.find_shard_sources(desc):
        source, target = entry.source_slice, entry.target_slice
        block = files.read(source.key, source.global_offset, source.local_shape)
        out[tuple(slice(t - o, t - o + n) for t, o, n in zip(target.global_offset, offset, target.local_shape))] = \
            postprocess(block, entry.postprocess_list)
    return out


def load_pretrained(model, directory):
    """Fill `model` (parallelized or not) with the weights save_pretrained wrote to `directory`. Collective
    over the mesh only to agree that every rank's checks passed; each rank then reads its own slices."""
    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"load_pretrained(model, directory) takes a paddle.nn.Layer, got {type(model).__name__}")
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise TypeError(f"load_pretrained(model, directory) takes a directory path, got {directory!r}")
    load_integrations(model)  # its library's weight names
    state = model.state_dict()
    specs = restore.expected_model_specs(model)
    problem, files, engine = None, None, None
    try:
        files = SafetensorsFiles(str(directory))
        engine = _engine(files, specs, loading_mapping(model), directory)
    except ValueError as exc:
        problem = exc
    failed = count_failures(layout.world_group(), problem is None, "pretrained_checked")
    if problem is not None:
        raise problem
    if failed:
        raise ValueError(f"load_pretrained: {directory} failed the checks on {failed} other rank(s) (their error "
                         "says why; is the directory visible to every rank?)")
    done = set()
    for key, tensor in state.items():
        if id(tensor) in done:
            continue  # a tied weight is read once
        done.add(id(tensor))
        # lazy or not (a lazy parameter counts as initialized afterwards); a rank that holds no value reads nothing
        store_local_value(tensor, layout.local_value(
            tensor, lambda offset, shape: _read_box(files, engine, key, tensor, offset, shape)))


