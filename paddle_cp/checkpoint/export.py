"""`export_pretrained(model, directory, merge_lora=False)`: the single-card weights as PaddleFormers
writes them (safetensors + config.json), for `ModelClass.from_pretrained(directory)`. For a PaddleFormers
`LoRAModel`: the adapter as its `save_pretrained(directory, save_checkpoint_format="unified")` writes it
on one card (the trained lora_A / lora_B, whole, named as in the wrapped model), for
`LoRAModel.from_pretrained(model, directory)`; with `merge_lora=True` the wrapped model with the adapter
merged into its weights, for its class's `from_pretrained`. Collective."""
from __future__ import annotations

import os

import numpy as np
import paddle
import paddle.distributed as dist

from .full_state import full_state_dict
from . import layout
from .agree import count_failures
from .lora_export import is_lora_model, merged_lora_state, save_lora_adapter


def export_pretrained(model, directory, merge_lora=False):
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise TypeError(f"export_pretrained(model, directory) takes a directory path, got {directory!r}")
    if not callable(getattr(model, "save_pretrained", None)) or getattr(model, "config", None) is None:
        raise TypeError(f"export_pretrained needs a PaddleFormers PretrainedModel (with .config and "
                        f".save_pretrained), got {type(model).__name__}: save a plain Layer with "
                        "pcp.save_checkpoint")
    if os.path.isfile(directory):
        raise ValueError(f"export directory {directory} is a file: pass a directory path")
    if not isinstance(merge_lora, bool):
        raise TypeError(f"merge_lora must be True or False, got {merge_lora!r}")
    if merge_lora and not is_lora_model(model):
        raise TypeError(f"merge_lora=True needs a PaddleFormers LoRAModel, got {type(model).__name__}: "
                        "export it without merge_lora")
    state = full_state_dict(model)
    error = None
    if dist.get_rank() == 0:
        tensors = {key: paddle.to_tensor(np.ascontiguousarray(value)) for key, value in state.items()}
        try:
            if is_lora_model(model) and not merge_lora:
                save_lora_adapter(model, tensors, directory)
            else:
                target, tensors = merged_lora_state(model, tensors) if merge_lora else (model, tensors)
                # the state_dict path of save_pretrained (its flex-checkpoint path saves the local shards and is
                # collective)
                target.save_pretrained(directory, state_dict=tensors, safe_serialization=True,
                                       save_checkpoint_format="unified")
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait for rank 0
            error = exc
    # every rank returns once the files exist, or raises the same error
    if count_failures(layout.world_group(), error is None, "export_written"):
        raise RuntimeError(f"export_pretrained to {directory} failed on rank 0 (the cause is chained there)") from error

