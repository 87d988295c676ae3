"""`export_pretrained(model, directory)`: the single-card weights as PaddleFormers writes them
(safetensors + config.json), for `ModelClass.from_pretrained(directory)`; for a PaddleFormers
`LoRAModel`, the adapter as its `save_pretrained(directory, save_checkpoint_format="unified")` writes
it on one card (the trained lora_A / lora_B, whole, named as in the wrapped model), for
`LoRAModel.from_pretrained(model, directory)`. Collective."""
from __future__ import annotations

import os

import numpy as np
import paddle
import paddle.distributed as dist

from .full_state import full_state_dict
from . import layout
from .agree import count_failures


def export_pretrained(model, directory):
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise TypeError(f"export_pretrained(model, directory) takes a directory path, got {directory!r}")
    if not callable(getattr(model, "save_pretrained", None)) or getattr(model, "config", None) is None:
        raise TypeError(f"export_pretrained needs a PaddleFormers PretrainedModel (with .config and "
                        f".save_pretrained), got {type(model).__name__}: save a plain Layer with "
                        "pcp.save_checkpoint")
    if os.path.isfile(directory):
        raise ValueError(f"export directory {directory} is a file: pass a directory path")
    state = full_state_dict(model)
    error = None
    if dist.get_rank() == 0:
        tensors = {key: paddle.to_tensor(np.ascontiguousarray(value)) for key, value in state.items()}
        try:
            if _is_lora_model(model):
                _save_lora_adapter(model, tensors, directory)
            else:
                # the state_dict path of save_pretrained (its flex-checkpoint path saves the local shards and is
                # collective)
                model.save_pretrained(directory, state_dict=tensors, safe_serialization=True,
                                      save_checkpoint_format="unified")
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait for rank 0
            error = exc
    # every rank returns once the files exist, or raises the same error
    if count_failures(layout.world_group(), error is None, "export_written"):
        raise RuntimeError(f"export_pretrained to {directory} failed on rank 0 (the cause is chained there)") from error


def _is_lora_model(model):
    return getattr(model, "lora_config", None) is not None and callable(
        getattr(model, "get_trainable_state_dict", None))


def _save_lora_adapter(lora_model, tensors, directory):
    """What LoRAModel.save_pretrained writes on one card in its "unified" format, from whole tensors: its own
    method would save each rank's local shards and wait in a barrier only rank 0 reaches."""
    from paddleformers.peft import LoRAConfig
    from paddleformers.utils.env import LORA_WEIGHTS_NAME

    prefix = "model."  # LoRAModel holds the model as .model; its files name parameters as the model does
    trained = [name for name, value in lora_model.model.state_dict().items() if not value.stop_gradient]
    os.makedirs(directory, exist_ok=True)
    paddle.save({name: tensors[prefix + name] for name in trained}, os.path.join(directory, LORA_WEIGHTS_NAME))
    LoRAConfig(**lora_model.lora_config.to_dict()).save_pretrained(directory)
    lora_model.model.config.save_pretrained(directory)
