"""PaddleFormers' own SFT/PT workflow (`run_tuner` -> `run_sft`) with paddle_cp's Trainer underneath.

Nothing of the workflow is rewritten: its argument parser, data pipeline (packing,
FlashMask row indices), model and tokenizer loading, LoRA, callbacks and
checkpoint rotation run as PaddleFormers wrote them. Three names are swapped for
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
  Trainer saves); one rank keeps PaddleFormers' own checkpoints and discovery.
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

# the stages whose workflow is run_sft (SFTTrainer); the others build trainers of their own
STAGES = ("SFT", "PT")
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
