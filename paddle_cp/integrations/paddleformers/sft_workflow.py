"""PaddleFormers' own SFT/PT workflow (`run_tuner` -> `run_sft`) with paddle_cp's Trainer underneath.

Nothing of the workflow is rewritten: its argument parser, data pipeline (packing,
FlashMask row indices, a VL model's processor and collator), tokenizer loading, LoRA, callbacks and
checkpoint rotation run as PaddleFormers wrote them. These names are swapped for
the length of the run, the narrowest seams it has:

- the `FinetuningArguments` dataclass its parser fills (`hparams.parser._TRAIN_ARGS`)
  becomes one that is also paddle_cp's `TrainingArguments`: the parallel keys
  build paddle_cp's mesh and plans instead of fleet's groups;
- the `SFTTrainer` that `run_sft` constructs (`sft.workflow.SFTTrainer`) becomes
  one that is also paddle_cp's `Trainer`: it parallelizes the one-card model,
  weighs the loss, writes and reads paddle_cp checkpoints;
- the `get_last_checkpoint` with which `run_sft` picks the checkpoint to resume
  from (the highest-numbered `checkpoint-<n>` folder, whole or not) becomes
  paddle_cp's newest committed checkpoint on more than one rank (where paddle_cp's
  Trainer saves); one rank keeps PaddleFormers' own checkpoints and discovery;
- the auto classes it builds the model with (`AutoModelForCausalLM`, `AutoModelForConditionalGeneration` for
  the VL stages) become `OneCardModels`: the one-card class paddle_cp splits where PaddleFormers would name
  fleet's, its weights read as on one card on every rank.
"""
from __future__ import annotations

import contextlib
import difflib
import importlib
from dataclasses import dataclass, fields

import paddle.distributed as dist
from paddleformers.cli.hparams.finetuning_args import FinetuningArguments as PaddleFormersFinetuningArguments
from paddleformers.cli.train.sft.sft_trainer import SFTTrainer as PaddleFormersSFTTrainer

import paddle_cp as pcp

from ...dtypes import matmul_takes
from .trainer import Trainer
from .training_args import TrainingArguments
from .weights import casting_to_model_dtypes

# the stages whose workflow is run_sft (SFTTrainer); the others build trainers of their own
STAGES = ("SFT", "PT", "VL-SFT", "VL-PT")
# compute types without quantized weights: fp32, or bf16/fp16 (PaddleFormers' AMP, its fp16_opt_level)
UNQUANTIZED_COMPUTE = ("bf16", "fp16", "float32")
FP32_COMPUTE = "float32"
PARSER_KEY = "custom_register_path"  # read by PaddleFormers' parser itself, not by an argument class


@dataclass
class FinetuningArguments(TrainingArguments, PaddleFormersFinetuningArguments):
    """PaddleFormers' CLI arguments whose parallel keys go to paddle_cp (TrainingArguments comes first in
    the MRO: it takes the parallel keys out before PaddleFormers' own __post_init__ sees them)."""

    def __post_init__(self):
        if dist.get_world_size() > 1 and self.compute_type not in UNQUANTIZED_COMPUTE:
            raise ValueError(
                f"compute_type {self.compute_type!r} is not supported by pcp-train on more than one rank: "
                "quantized weights are not wired into paddle_cp's Trainer; set compute_type to one of "
                f"{list(UNQUANTIZED_COMPUTE)}")
        super().__post_init__()
        refuse_a_model_no_matmul_takes(self.compute_type, self.fp16_opt_level)
        if self.paddle_cp_degrees.parallel:
            pcp.set_mesh(self.paddle_cp_mesh)  # the mesh OneCardModels loads the weights over, before parallelize

    def _mixed_precision(self):
        # PaddleFormers' __post_init__ sets bf16 or fp16 from compute_type after paddle_cp's checks ran
        return self.compute_type != FP32_COMPUTE


LOW_PRECISION_COMPUTE = {"bf16": "bfloat16", "fp16": "float16"}


def refuse_a_model_no_matmul_takes(compute_type, fp16_opt_level):
    """run_sft loads the model in bf16/fp16 at O2; on a device whose matmul takes neither (Paddle's CPU builds)
    its first forward would fail deep in a kernel lookup, after every rank built the data and the model."""
    dtype = LOW_PRECISION_COMPUTE.get(compute_type)
    if fp16_opt_level == "O2" and dtype and not matmul_takes(dtype):
        raise ValueError(
            f"fp16_opt_level O2 with compute_type {compute_type!r} loads the model in {dtype}, and this device's "
            f"matmul takes no {dtype} (Paddle's CPU builds have none): set fp16_opt_level=O1 (on CPU Paddle's AMP is "
            "then a no-op and the run trains in fp32), or compute_type=float32 with amp_master_grad=false, or run on "
            "GPUs")


def check_config(args):
    """What pcp-train refuses before any rank starts, from the config dict alone: the stage, the keys, and a
    model dtype this device cannot multiply (the ranks check again, on the parsed arguments)."""
    check_stage(args)
    check_keys(args)
    defaults = {f.name: f.default for f in fields(FinetuningArguments)}
    refuse_a_model_no_matmul_takes(args.get("compute_type", defaults["compute_type"]),
                                   args.get("fp16_opt_level", defaults["fp16_opt_level"]))


# model_type -> its one-card class, for the families whose class PaddleFormers 1.2.0's auto classes name is fleet's
# (built on qwen3_vl/modeling_fleet: needs paddlefleet, which has no CPU build, and holds fleet's own parallel
# layers, which paddle_cp does not split); the other vision-language families have one class, the one-card one
ONE_CARD_CLASSES = {"qwen3_vl": "Qwen3VLForConditionalGenerationDeprecated",
                    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGenerationDeprecated"}


class OneCardModels:
    """One of run_sft's auto classes (`AutoModelForCausalLM`, `AutoModelForConditionalGeneration`): the family's
    one-card class (ONE_CARD_CLASSES, else the auto class's choice), its weights read as on one card. On more than
    one rank PaddleFormers' own loading cannot: its flex-checkpoint loader (the one that applies the class's
    `_gen_aoa_config`: fused q/k/v and gate/up, transposes) exchanges tensors between ranks through the GPU, and
    with paddle_cp's `load_checkpoint_format` None its legacy loader skips that mapping, leaving fused weights
    newly initialized. There paddle_cp's load_pretrained applies the same mapping on each rank, and the same casts
    (each weight in its parameter's dtype)."""

    def __init__(self, auto_class):
        self.auto_class = auto_class

    def model_class(self, config):
        name = ONE_CARD_CLASSES.get(config.model_type)
        if name is None:
            return self.auto_class
        return getattr(importlib.import_module(f"paddleformers.transformers.{config.model_type}.modeling"), name)

    def from_pretrained(self, path, *args, config, **kwargs):
        model_class = self.model_class(config)
        if dist.get_world_size() == 1:
            return model_class.from_pretrained(path, *args, config=config, **kwargs)
        return loaded_as_on_one_card(model_class, path, config)

    def from_config(self, config, **kwargs):
        return self.model_class(config).from_config(config, **kwargs)


def loaded_as_on_one_card(model_class, path, config):
    """`model_class` built from `config` (its dtype), with the weights from_pretrained would give it from `path`."""
    model = model_class.from_config(config)
    with casting_to_model_dtypes():
        pcp.load_pretrained(model, path)
    return model


AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForConditionalGeneration")


@contextlib.contextmanager
def one_card_models():
    """run_sft builds its model through OneCardModels, until exit."""
    workflow = importlib.import_module("paddleformers.cli.train.sft.workflow")
    saved = {name: getattr(workflow, name) for name in AUTO_CLASSES}
    for name, auto_class in saved.items():
        setattr(workflow, name, OneCardModels(auto_class))
    try:
        yield
    finally:
        for name, auto_class in saved.items():
            setattr(workflow, name, auto_class)


class SFTTrainer(Trainer, PaddleFormersSFTTrainer):
    """PaddleFormers' SFTTrainer (its logging, evaluation with generation, dataset preparation) on
    paddle_cp's Trainer (parallelize, loss weighting, data-parallel batches, checkpoints)."""


def check_stage(args):
    """A stage pcp-train cannot run, refused before anything is built (every rank reads the same YAML)."""
    stage = args.get("stage", "SFT")
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} is not supported by pcp-train: it runs PaddleFormers' run_sft "
                         f"(stages {list(STAGES)}); use paddleformers-cli for the others")


def check_keys(args):
    """Keys no argument class of the workflow takes (a misspelt one), refused with the closest known keys before any
    rank starts: PaddleFormers' parser would refuse them on every rank, after the launch, without a suggestion."""
    parser = importlib.import_module("paddleformers.cli.hparams.parser")
    classes = [FinetuningArguments if cls is PaddleFormersFinetuningArguments else cls for cls in parser._TRAIN_ARGS]
    known = {PARSER_KEY} | {f.name for cls in classes for f in fields(cls) if f.init}
    unknown = sorted(set(args) - known)
    if unknown:
        close = {key: difflib.get_close_matches(key, known, n=1, cutoff=0.7) for key in unknown}
        hints = "; ".join(f"{key}: did you mean {near[0]}?" if near else f"{key}: no such key"
                          for key, near in close.items())
        raise ValueError(f"unknown keys {unknown} in the config (PaddleFormers' parser takes none of them): {hints}")


def committed_checkpoint_finder(paddleformers_finder):
    """run_sft's `get_last_checkpoint(folder)`: paddle_cp's newest committed checkpoint on more than one rank."""
    def last_checkpoint(folder, *args, **kwargs):
        if dist.get_world_size() > 1:
            return pcp.latest_checkpoint(folder)
        return paddleformers_finder(folder, *args, **kwargs)

    return last_checkpoint


@contextlib.contextmanager
def paddle_cp_underneath():
    """PaddleFormers' parser fills paddle_cp's arguments, run_sft builds paddle_cp's trainer and resumes from what
    paddle_cp committed, until exit."""
    parser = importlib.import_module("paddleformers.cli.hparams.parser")
    workflow = importlib.import_module("paddleformers.cli.train.sft.workflow")
    train_args = [FinetuningArguments if cls is PaddleFormersFinetuningArguments else cls
                  for cls in parser._TRAIN_ARGS]
    saved = parser._TRAIN_ARGS, workflow.SFTTrainer, workflow.get_last_checkpoint
    parser._TRAIN_ARGS, workflow.SFTTrainer = train_args, SFTTrainer
    workflow.get_last_checkpoint = committed_checkpoint_finder(workflow.get_last_checkpoint)
    try:
        with one_card_models():
            yield
    finally:
        parser._TRAIN_ARGS, workflow.SFTTrainer, workflow.get_last_checkpoint = saved


def run(args):
    """PaddleFormers' `run_tuner(args)` (args: the dict its CLI reads from YAML + overrides) on this rank."""
    from paddleformers.cli.train.tuner import run_tuner

    check_stage(args)
    check_keys(args)
    with paddle_cp_underneath():
        run_tuner(args)
