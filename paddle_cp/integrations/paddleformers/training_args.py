"""PaddleFormers' TrainingArguments, with its parallel flags kept for paddle_cp instead of fleet.

PaddleFormers' `__post_init__` turns the parallel flags into fleet's hybrid groups
(and refuses context parallel with data parallel, or ring with Ulysses). Here the
flags are taken out before it runs and become `paddle_cp_degrees`; PaddleFormers
then sets itself up as plain one-process-per-rank training, and the few places
its Trainer reads the data-parallel layout (dataset_world_size, dataset_rank,
data_parallel_rank) answer from paddle_cp's mesh.

After construction the fleet flags read as PaddleFormers' one-card values (-1,
False, no sharding): scripts copy them into the model config, where they would
build fleet's parallel layers. paddle_cp splits the one-card model instead.
`tensorwise_offload_optimizer` becomes `paddle_cp_offload_optimizer` (dp_config
offload_optimizer) and reads False, so PaddleFormers applies none of its own offload.
Likewise `amp_master_grad` (with bf16/fp16) becomes `paddle_cp_master_grad` and reads
False: PaddleFormers would otherwise keep a `main_grad` beside each parameter (leaving
`.grad` None for paddle_cp's buckets) and all-reduce it again over every rank; paddle_cp's
Trainer asks Paddle for fp32 gradients instead (`decorate(master_grad=True)`), which
paddle_cp accumulates and reduces in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import numpy as np
import paddle.distributed as dist
from paddleformers.trainer import TrainingArguments as PaddleFormersTrainingArguments

import paddle_cp as pcp

from .degrees import degrees_from_flags, degrees_from_mesh

# flag -> the value under which PaddleFormers sets up no hybrid parallelism
FLEET_FLAGS = {
    "context_parallel_size": -1,
    "sep_parallel_size": -1,
    "tensor_model_parallel_size": -1,
    "pipeline_model_parallel_size": -1,
    "sharding": "",
    "sharding_parallel_size": -1,
    "sequence_parallel": False,
    "use_expert_parallel": False,
    "expert_model_parallel_size": -1,
}

# flags whose PaddleFormers implementation needs fleet or its own checkpoint formats: refused with the reason
UNSUPPORTED = {
    "enable_auto_parallel": "PaddleFormers' own auto-parallel path (DistTensors); paddle_cp replaces it",
    "distributed_dataloader": "fleet's DistDataLoader needs its hybrid groups; every rank reads its own samples here",
    "load_best_model_at_end": "it reloads with PaddleFormers' checkpoint formats; load the best paddle_cp "
                              "checkpoint with paddle_cp.load_checkpoint instead",
    "enable_zero_cost_checkpoint": "a fleet checkpoint path; paddle_cp writes its own checkpoints",
    "save_sharded_model": "a fleet checkpoint format; paddle_cp writes its own checkpoints",
    "load_sharded_model": "a fleet checkpoint format; paddle_cp reads its own checkpoints",
    "to_static": "static graphs are not supported: paddle_cp's plans are dygraph hooks",
}


def _refuse_unsupported(args):
    for name, reason in UNSUPPORTED.items():
        value = getattr(args, name, None)
        if value is True or (type(value) is int and value > 1):
            raise ValueError(f"{name}={value!r} is not supported by paddle_cp's Trainer: {reason}")


@dataclass
class TrainingArguments(PaddleFormersTrainingArguments):
    paddle_cp_config: Optional[str] = field(
        default=None,
        metadata={"help": "A paddle_cp YAML config (path, or a dict when built in Python) whose mesh and plans "
                          "replace the ones derived from the parallel flags (paddle_cp.load_config)."},
    )
    pipeline_schedule_mode: str = field(
        default="1F1B", metadata={"help": "paddle_cp pipeline schedule: FThenB, 1F1B or VPP"})
    offload_recompute_inputs: bool = field(
        default=False, metadata={"help": "Keep the inputs each fully recomputed decoder layer saves in host memory "
                                         "until its backward (paddle_cp.OffloadRecomputeInputs); needs "
                                         "recompute_granularity='full'."})
    mlp_tile_tokens: int = field(
        default=0, metadata={"help": "Run each decoder layer's MLP over the sequence in tiles of this many tokens "
                                     "(paddle_cp.SequenceTiled); 0: untiled."})
    tries_per_step: int = field(
        default=3, metadata={"help": "Attempts of a parallel run (Paddle's launch restarting it) that may fail first "
                                     "at the same step before the next one stops the job with that step and the "
                                     "first error instead of training again (paddle_cp's crash-loop rule; 0: "
                                     "never). overwrite_output_dir starts the count again."})

    def __post_init__(self):
        # everything here is arithmetic on the arguments: a bad combination raises on every rank alike
        if self.offload_recompute_inputs and self.recompute_granularity != "full":
            raise ValueError(f"offload_recompute_inputs keeps fully recomputed layers' inputs on the host, but "
                             f"recompute_granularity is {self.recompute_granularity!r}: set it to 'full' (and the "
                             "model config's recompute flags with it) or drop offload_recompute_inputs")
        if isinstance(self.mlp_tile_tokens, bool) or not isinstance(self.mlp_tile_tokens, int) or self.mlp_tile_tokens < 0:
            raise ValueError(f"mlp_tile_tokens takes tokens per tile (0: untiled), got {self.mlp_tile_tokens!r}")
        tries = self.tries_per_step
        if isinstance(tries, bool) or not isinstance(tries, int) or tries < 0:
            raise ValueError(f"tries_per_step takes a whole number >= 0 (0: no crash-loop rule), got "
                             f"{self.tries_per_step!r}")
        flags = {name: getattr(self, name) for name in FLEET_FLAGS}
        if self.paddle_cp_config is not None:
            defaults = {f.name: f.default for f in fields(self)}
            given = sorted(name for name in FLEET_FLAGS if flags[name] != defaults[name])
            if given:
                raise ValueError(f"paddle_cp_config brings its own mesh and plans: drop the parallel flags {given}")
            self.paddle_cp_mesh, self.paddle_cp_plan_config = pcp.load_config(self.paddle_cp_config)
            level = (self.paddle_cp_plan_config.get("dp_config") or {}).get("sharding_level", 0)
            self.paddle_cp_degrees = degrees_from_mesh(self.paddle_cp_mesh, level)
        else:
            self.paddle_cp_degrees = degrees_from_flags(dist.get_world_size(), **flags)
            self.paddle_cp_mesh, self.paddle_cp_plan_config = self.paddle_cp_degrees.mesh(), None
        for name, neutral in FLEET_FLAGS.items():
            setattr(self, name, neutral)
        # paddle_cp steps the optimizer state on the host itself (dp_config offload_optimizer, at any sharding
        # level); PaddleFormers' own offload patches Paddle's adamw_ process-wide and refuses data parallel
        self.paddle_cp_offload_optimizer = bool(self.tensorwise_offload_optimizer) and self.paddle_cp_degrees.parallel
        if self.paddle_cp_offload_optimizer:
            self.tensorwise_offload_optimizer = False
        if self.paddle_cp_degrees.parallel:
            _refuse_unsupported(self)
            if self.paddle_cp_degrees.sharding_level == 3 and self.gradient_accumulation_steps > 1:
                # PaddleFormers averages accumulated gradients by scaling p.grad; at level 3 the gradients of
                # parameters another dp rank owns wait in paddle_cp's sharding buffer instead, unscaled
                raise ValueError("sharding stage3 with gradient_accumulation_steps > 1 is not supported by "
                                 "paddle_cp's Trainer yet: use --sharding stage2, or a larger per-device batch "
                                 "without accumulation")
            # paddle_cp writes and reads its own checkpoints; PaddleFormers' formats would start fleet
            self.save_checkpoint_format = self.load_checkpoint_format = None
            self.unified_checkpoint = False
        if not self._mixed_precision():
            self.amp_master_grad = False  # PaddleFormers refuses its default True without AMP
        super().__post_init__()
        self.paddle_cp_master_grad = bool(self.amp_master_grad) and self.paddle_cp_degrees.parallel
        if self.paddle_cp_master_grad:
            self.amp_master_grad = False
        self.paddle_cp_flags = flags  # what the user asked for, for the record

    def _mixed_precision(self):
        """Whether PaddleFormers' __post_init__ keeps bf16 or fp16 on (its amp_master_grad needs one)."""
        return bool(self.bf16 or self.fp16)

    @property
    def dataset_world_size(self):
        """Ranks that read different samples: the data-parallel ones (context and tensor parallel
        ranks of one replica read the same samples)."""
        return self.paddle_cp_degrees.dp

    @property
    def dataset_rank(self):
        return self.data_parallel_rank

    @property
    def data_parallel_rank(self):
        degrees = self.paddle_cp_degrees
        if degrees.dp == 1:
            return 0
        mesh = self.paddle_cp_mesh
        coordinates = np.argwhere(np.array(mesh.process_ids).reshape(mesh.shape) == dist.get_rank())[0]
        return int(coordinates[list(mesh.dim_names).index("dp")])
