"""PaddleFormers' weight files (checkpoint/weight_formats.py's seam): the AOA configs its `from_pretrained` and
`save_pretrained` apply (the model class's `_gen_aoa_config` / `_gen_inv_aoa_config`), its shard-size parser, and
a LoRAModel's files from whole tensors on rank 0: its adapter as LoRAModel writes it on one card, or the wrapped
model with the adapter merged into its weights."""
from __future__ import annotations

import contextlib
import os

import paddle

from paddle_cp import AdapterFormat, WeightFormat, runtime
from paddle_cp.checkpoint.weight_formats import PLAIN

PREFIX = "model."  # LoRAModel holds the model as .model; its files name parameters as the model does


def is_pretrained_model(model):
    """A PretrainedModel (or a LoRAModel around one): what save_pretrained and from_pretrained take."""
    return callable(getattr(model, "save_pretrained", None)) and getattr(model, "config", None) is not None


@contextlib.contextmanager
def casting_to_model_dtypes():
    """While open, the loading mapping also casts each file tensor to its parameter's dtype, as from_pretrained
    does for the dtype it is given (run_sft's model at O2: bf16 parameters from fp32 files)."""
    runtime.state.casting_to_model_dtypes = True
    try:
        yield
    finally:
        runtime.state.casting_to_model_dtypes = False


def loading_mapping(model):
    """The AOA statements from_pretrained applies for this model class (none: names and layouts as stored)."""
    generate = getattr(type(model), "_gen_aoa_config", None)
    mapping = generate(model.config) if generate is not None else PLAIN
    if not runtime.state.casting_to_model_dtypes:
        return mapping
    casts = [f"{key} -> {key}, dtype='{str(value.dtype).replace('paddle.', '')}'"
             for key, value in model.state_dict().items()]
    return {**mapping, "aoa_statements": [*mapping.get("aoa_statements", []), *casts]}


def saving_mapping(model):
    """The AOA statements save_pretrained applies (derived from the loading ones when the class has no inverse)."""
    cls = type(model)
    if hasattr(cls, "_gen_inv_aoa_config"):
        return cls._gen_inv_aoa_config(model.config)
    if hasattr(cls, "_gen_aoa_config"):
        return dict(cls._gen_aoa_config(model.config), aoa_config_reverse=True)
    return PLAIN


def shard_size(max_shard_size):
    from paddleformers.transformers.utils import convert_file_size_to_int

    return convert_file_size_to_int(max_shard_size)


def is_lora_model(model):
    return getattr(model, "lora_config", None) is not None and callable(
        getattr(model, "get_trainable_state_dict", None))


def save_lora_adapter(lora_model, tensors, directory):
    """What LoRAModel.save_pretrained(directory, save_checkpoint_format="unified") writes on one card: its own
    method, called on every rank, would save each rank's local shards and wait in a barrier only rank 0 reaches."""
    from paddleformers.peft import LoRAConfig
    from paddleformers.utils.env import LORA_WEIGHTS_NAME

    trained = [name for name, value in lora_model.model.state_dict().items() if not value.stop_gradient]
    os.makedirs(directory, exist_ok=True)
    paddle.save({name: tensors[PREFIX + name] for name in trained}, os.path.join(directory, LORA_WEIGHTS_NAME))
    LoRAConfig(**lora_model.lora_config.to_dict()).save_pretrained(directory)
    lora_model.model.config.save_pretrained(directory)


def merged_lora_state(lora_model, tensors):
    """(the wrapped model, its state dict with each LoRA linear's weight + its own get_delta_weight of the whole
    factors, the factors dropped): what a plain model of its class loads and computes the same with."""
    state = {name[len(PREFIX):]: value for name, value in tensors.items()}
    for name, layer in lora_model.model.named_sublayers():
        if callable(getattr(layer, "get_delta_weight", None)) and f"{name}.lora_A" in state:
            lora_a, lora_b = state.pop(f"{name}.lora_A"), state.pop(f"{name}.lora_B")
            if not (layer.merged or layer.disable_lora):  # merged: the weight holds it; disabled: unused
                state[f"{name}.weight"] = state[f"{name}.weight"] + layer.get_delta_weight(lora_a, lora_b)
    return lora_model.model, state


WEIGHT_FORMAT = WeightFormat(claims=is_pretrained_model, loading=loading_mapping, saving=saving_mapping,
                             shard_size=shard_size,
                             adapter=AdapterFormat(is_adapter=is_lora_model, prefix=PREFIX, save=save_lora_adapter,
                                                   merged=merged_lora_state))
