"""PaddleFormers' Trainer, parallelized by paddle_cp instead of fleet.

PaddleFormers runs its own loop (data, accumulation, logging, saving); this
subclass replaces only what fleet did:
- `_wrap_model`: `paddle_cp.parallelize(model, optimizer, mesh, config)` with the
  plans derived from the model (plans.py) or the user's paddle_cp config
  (`tensorwise_offload_optimizer`: its dp_config's `offload_optimizer`);
- `_wrap_amp_model`: PaddleFormers' own bf16/fp16 set-up (O2 casts the one-card model,
  a GradScaler), then its scaler through `paddle_cp.shard_scaler` and, with
  `amp_master_grad`, Paddle's fp32 master gradients for the same parameters, asked
  before parallelize plans its gradient buckets;
- `_get_train_sampler`: every data-parallel rank its part of one card's batch (data.py);
- `compute_loss`: each rank's mean loss weighted by `paddle_cp.loss_weight`, so the
  averaged gradient and the logged world mean are one card's token mean;
- `_save_checkpoint` / `_load_from_checkpoint` / `_load_optimizer_and_scheduler` /
  `save_model`: paddle_cp checkpoints inside `checkpoint-<step>` with the Trainer's
  state, scheduler and RNG files in the same atomic commit, loaded onto whatever mesh
  runs now;
- `train`: resumes by default from the newest committed checkpoint in `output_dir`
  (unless `overwrite_output_dir`), never from PaddleFormers' `get_last_checkpoint`,
  which takes the highest-numbered folder, complete or not; a SIGTERM or SIGUSR1 to
  any rank saves and stops every rank at the same step (preemption.py); each call is an
  attempt of the job in `output_dir`'s history, a step that raises recorded, and the
  attempt after `tries_per_step` failed first at one step stops the job instead
  (recovery/attempts.py, as pcp.Resumable);
- `train`: `paddle.device.synchronize()` (called with gradient accumulation) has
  nothing to wait for on CPU, where Paddle raises.
"""
from __future__ import annotations

import contextlib
import os
import random

import numpy as np
import paddle
import paddle.distributed as dist
from paddleformers.trainer import Trainer as PaddleFormersTrainer
from paddleformers.trainer import TrainerState
from paddleformers.trainer.trainer_utils import has_length
from paddleformers.utils.env import PREFIX_CHECKPOINT_DIR, SCHEDULER_NAME, TRAINER_STATE_NAME
from paddleformers.utils.log import logger

import paddle_cp as pcp

from ... import mesh as mesh_lib
from ...recovery import attempts, signals
from .data import DataParallelBatchSampler
from ...sequence.empty_share import guard_loss_layers, guards_loss
from .loss import PipelineLoss, local_tokens
from .preemption import PreemptionStop
from .plans import layout_summary, parallelize_config, prepare_plan, with_memory_plans, with_offload_optimizer
from .training_args import TrainingArguments

IGNORED_LABEL = -100  # PaddleFormers' default `ignored_index`


@contextlib.contextmanager
def _no_device_sync_on_cpu():
    """PaddleFormers calls paddle.device.synchronize() before scaling accumulated gradients; a CPU
    build raises there, and a CPU has no queue to wait for."""
    if paddle.is_compiled_with_cuda() or paddle.is_compiled_with_xpu():
        yield
        return
    synchronize = paddle.device.synchronize
    paddle.device.synchronize = lambda device=None: None
    try:
        yield
    finally:
        paddle.device.synchronize = synchronize


class Trainer(PaddleFormersTrainer):
    def __init__(self, model=None, criterion=None, args=None, *rest, **kwargs):
        if not isinstance(args, TrainingArguments):
            raise TypeError("paddle_cp's Trainer takes paddle_cp.integrations.paddleformers.TrainingArguments "
                            f"(it carries the parallel degrees), got {type(args).__name__}")
        super().__init__(model, criterion, args, *rest, **kwargs)
        degrees = args.paddle_cp_degrees
        self.paddle_cp_config = None
        if degrees.parallel:
            # derived (and checked) here, on every rank alike, before any collective
            self.paddle_cp_config = args.paddle_cp_plan_config
            if self.paddle_cp_config is None:
                self.paddle_cp_config = parallelize_config(model, degrees, args.pipeline_schedule_mode,
                                                           micro_batches=self._pipeline_micro_batches())
            self.paddle_cp_config = with_memory_plans(self.paddle_cp_config, model, args.offload_recompute_inputs,
                                                      args.mlp_tile_tokens)
            self.paddle_cp_config = with_offload_optimizer(self.paddle_cp_config, args.paddle_cp_offload_optimizer)
        elif args.offload_recompute_inputs or args.mlp_tile_tokens:
            raise ValueError("offload_recompute_inputs and mlp_tile_tokens are applied by paddle_cp.parallelize, which "
                             "this Trainer runs only with a parallel layout (more than one rank)")
        self._prepare_plan = prepare_plan(self.paddle_cp_config or {})
        self._pipeline_loss = None
        pp_config = (self.paddle_cp_config or {}).get("pp_config")
        if pp_config and "loss_fn" not in pp_config:
            self._pipeline_loss = PipelineLoss(model, self._prepare_plan, pp_config.get("accumulate_steps", 1),
                                               self._ignored_label())
            pp_config = {**pp_config, "loss_fn": self._pipeline_loss}
            self.paddle_cp_config = {**self.paddle_cp_config, "pp_config": pp_config}
        self._parallelized = False
        if degrees.parallel:
            self.add_callback(PreemptionStop())

    def _pipeline_micro_batches(self):
        """Micro-batches of one pipelined forward: one sample each (fills the pipeline once the
        per-device batch reaches the stage count)."""
        return self.args.per_device_train_batch_size if self.args.paddle_cp_degrees.pp > 1 else 1

    @property
    def _distributed(self):
        return self.args.paddle_cp_degrees.parallel

    # ---- mixed precision -----------------------------------------------------------------
    def _wrap_amp_model(self, args, model):
        super()._wrap_amp_model(args, model)
        if not args.paddle_cp_degrees.parallel:
            return
        # gradients reduced before unscaling, found-inf agreed over the mesh (on CPU Paddle disables the scaler)
        self.scaler = pcp.shard_scaler(self.scaler)
        if args.paddle_cp_master_grad and args.fp16_opt_level == "O2":
            # Paddle casts these parameters' gradients to fp32 at the end of every backward; paddle_cp then
            # accumulates and reduces them in fp32. Registered before parallelize, which splits each parameter
            # in place and sizes its buckets by the gradients' dtype. The model was cast above: every layer is
            # excluded so this casts nothing more (on CPU decorate does nothing at all)
            paddle.amp.decorate(models=model, level="O2", dtype=self.amp_dtype, master_grad=True,
                                excluded_layers=model)

    # ---- model and optimizer -------------------------------------------------------------
    def _wrap_model(self, model, training=True):
        if not self._distributed:
            return super()._wrap_model(model, training)
        if self._parallelized or not training:
            return model
        if self.optimizer is None:
            raise ValueError("paddle_cp parallelizes the model together with its optimizer: create the optimizer "
                             "first (Trainer.train does)")
        model, self.optimizer = pcp.parallelize(model, self.optimizer, self.args.paddle_cp_mesh,
                                                self.paddle_cp_config)
        if self.args.should_log:  # what runs where, once: the flags' layout as paddle_cp built it
            logger.info(layout_summary(self.args.paddle_cp_mesh, self.paddle_cp_config))
        if self.args.gradient_accumulation_steps > 1:
            # the Trainer scales every `.grad` by 1/k between the last backward and the step: a bucket reduced
            # during that backward has none to scale (data_parallel/buckets.py)
            self.optimizer.keep_gradients_until_step()
        degrees = self.args.paddle_cp_degrees
        # the same on every rank, before a step (a pipeline's stages hold its loss or not; PipelineLoss weighs)
        pipelined = bool((self.paddle_cp_config or {}).get("pp_config"))
        if degrees.dp * degrees.sep > 1 and not pipelined:
            if self.criterion is not None:  # the Trainer's own criterion, called on the model's output
                guard_loss_layers(self.criterion)
            if not guards_loss(self.criterion if self.criterion is not None else model):
                raise ValueError(
                    f"{type(self.criterion or model).__name__}'s loss is no layer paddle_cp guards: a rank whose part "
                    "of the batch holds no label would train on its 0/0 token mean (NaN gradients). Register its "
                    "loss layer with pcp.register_loss_layer(pcp.LossLayer(...)) (sequence/empty_share.py)")
        self._parallelized = True
        return model

    # ---- data and loss -------------------------------------------------------------------
    def _get_train_sampler(self):
        if not self._distributed or self.train_dataset is None or not has_length(self.train_dataset):
            return super()._get_train_sampler()
        args = self.args
        return DataParallelBatchSampler(self.train_dataset, args.per_device_train_batch_size,
                                        args.paddle_cp_degrees.dp, args.dataset_rank, args.dataloader_shuffle,
                                        args.dataloader_drop_last, args.seed)

    def _ignored_label(self):
        return getattr(getattr(self.model, "config", None), "ignored_index", IGNORED_LABEL)

    def _counted_mask(self, model, inputs):
        """The batch's loss_mask where the loss counts its tokens by it: the model's own PaddleFormers criterion
        (the Trainer's `criterion` gets no mask) without use_filtered_label_loss; else None (by the labels)."""
        criterion = getattr(model, "criterion", None)
        if self.criterion is not None or criterion is None or getattr(criterion, "use_filtered_label_loss", False):
            return None
        return inputs.get("loss_mask")

    def compute_loss(self, model, inputs, return_outputs=False):
        degrees = self.args.paddle_cp_degrees
        if self._pipeline_loss is not None and self._parallelized and model.training:
            self._pipeline_loss.start_step(inputs)  # the schedule weighs each micro-batch's loss
            return super().compute_loss(model, inputs, return_outputs=return_outputs)
        weigh = self._parallelized and degrees.dp * degrees.sep > 1 and inputs.get("labels") is not None
        tokens = local_tokens(inputs["labels"], self._prepare_plan, self._ignored_label(), inputs,
                              self._counted_mask(model, inputs)) if weigh else None
        result = super().compute_loss(model, inputs, return_outputs=return_outputs)
        if not weigh:
            return result
        weight = pcp.loss_weight(tokens)
        if return_outputs:
            return result[0] * weight, result[1]
        return result * weight

    def train(self, resume_from_checkpoint=None, ignore_keys_for_eval=None):
        if not self._distributed:
            with _no_device_sync_on_cpu():
                return super().train(resume_from_checkpoint, ignore_keys_for_eval)
        resume_from_checkpoint = self._checkpoint_to_resume(resume_from_checkpoint)
        root, rank = self.args.output_dir, dist.get_rank()
        resumed = _global_step(resume_from_checkpoint)  # every rank: a file that fails to load fails on all
        attempt = attempts.enter(root, self.args.tries_per_step, mesh_lib.dims_of(self.args.paddle_cp_mesh).world,
                                 forget=self.args.overwrite_output_dir)
        if rank == 0:
            attempts.start_attempt(root, attempt, resumed, dist.get_world_size())
        try:
            with _no_device_sync_on_cpu():
                return super().train(resume_from_checkpoint, ignore_keys_for_eval)
        except Exception as exc:
            # the step being run (before the state is restored: the one after the checkpoint's)
            attempts.record_failure(root, attempt, rank, max(self.state.global_step, resumed) + 1, exc)
            signals.restore_handlers()  # PaddleFormers' on_train_end, which restores them, is not called
            raise

    # ---- checkpoints ---------------------------------------------------------------------
    def _checkpoint_to_resume(self, asked):
        """None (the default): the newest committed checkpoint in output_dir, unless overwrite_output_dir; True: the
        same, which must exist; False: none; a path: that one (loading checks it is complete)."""
        if asked is False or asked is None and self.args.overwrite_output_dir:
            return None
        if asked is None or asked is True:
            latest = pcp.latest_checkpoint(self.args.output_dir)
            if latest is None and asked is True:
                raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {self.args.output_dir}")
            return latest
        return asked

    def _save_checkpoint(self, model, metrics=None):
        if not self._distributed:
            return super()._save_checkpoint(model, metrics)
        folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        optimizer = None if self.args.ignore_save_lr_and_optim else self.optimizer
        pcp.save_checkpoint(folder, self.model, optimizer, extra={"global_step": self.state.global_step},
                            rank_files=self._write_trainer_files)
        if self.args.should_save:
            self._rotate_checkpoints(use_mtime=True, output_dir=self.args.output_dir)

    def _write_trainer_files(self, folder):
        """What PaddleFormers resumes from beside the weights (its state, scheduler, this rank's RNG), written into
        the checkpoint before it is committed: a committed checkpoint has all of them."""
        if self.args.should_save:
            self.state.save(os.path.join(folder, TRAINER_STATE_NAME))
            paddle.save(self.lr_scheduler.state_dict(), os.path.join(folder, SCHEDULER_NAME))
        if self.args.save_rng_states:
            paddle.save(_rng_state(self.args.world_size), os.path.join(folder, f"rng_state_{dist.get_rank()}.pth"))

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        if not self._distributed:
            return super()._load_from_checkpoint(resume_from_checkpoint)
        # the weights load after parallelize, with the optimizer state (_load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if not self._distributed:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        keep_optimizer = not self.args.ignore_load_lr_and_optim
        pcp.load_checkpoint(checkpoint, self.model, self.optimizer if keep_optimizer else None)
        if keep_optimizer:
            self._load_scheduler(checkpoint)

    def save_model(self, output_dir=None, merge_tensor_parallel=False, last_fc_to_hf=False):
        """What `from_pretrained` loads: the single-card weights (and config) in safetensors."""
        if not self._distributed:
            return super().save_model(output_dir, merge_tensor_parallel, last_fc_to_hf)
        output_dir = output_dir or self.args.output_dir
        pcp.export_pretrained(self.model, output_dir)
        if self.args.should_save:
            # beside the weights, as PaddleFormers' save_model: the tokenizer, a VL model's processor (AutoProcessor)
            for processing in (self.tokenizer, self.processing_class):
                if processing is not None:
                    processing.save_pretrained(output_dir)


def _global_step(checkpoint):
    """The steps done at `checkpoint`, from the Trainer state written into it (0: none, or a checkpoint without one,
    from which PaddleFormers starts at step 0 too)."""
    path = os.path.join(checkpoint, TRAINER_STATE_NAME) if checkpoint is not None else None
    return TrainerState.load(path).global_step if path is not None and os.path.isfile(path) else 0


def _rng_state(world_size):
    """The RNG file PaddleFormers' `_load_rng_state` reads."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "cuda": paddle.get_rng_state(),
            "cpu": paddle.framework.core.default_cpu_generator().get_state(), "world_size": world_size}
