"""paddle_cp: context-parallel training for PaddlePaddle, behind Paddle's `parallelize` API."""
from .attention import attention_work, hybrid_attention, ring_attention, ulysses_attention
from .attention.mixers import TokenMixer, register_attention_class, register_mixer
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, wait_checkpoint
from .checkpoint.export import export_pretrained
from .checkpoint.pretrained import load_pretrained
from .cost.links import Links
from .comm import bytes_sent, reset_counters
from .comm.watchdog import get_timeout, set_timeout
from .api.config import load_config
from .mesh import get_mesh, set_mesh
from .api.parallelize import parallelize, parallelize_model, parallelize_optimizer
from .api.paddle_compat import patch_paddle, unpatch_paddle
from .api.parity import check_parity
from .api.plan_annotation import register_fused_weights
from .experts.blocks import BlockKind, register_block_kind
from .attention.adapters import register_adapter
from .checkpoint.weight_formats import AdapterFormat, WeightFormat, register_weight_format
from .activations.recompute_settings import RecomputeSetting, register_recompute_setting
from .data_parallel.scaler import shard_scaler
from .pipeline import SplitPoint
from .sequence.batches import shard_batch, shard_dataloader
from .sequence.loss import loss_weight
from .sequence.empty_share import LossLayer, register_loss_layer
from .plans import (
    ColWiseParallel,
    ContextParallel,
    ConvParallel,
    ExpertParallel,
    OffloadRecomputeInputs,
    PrepareContextParallel,
    PrepareLayerInput,
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
    SequenceTiled,
    TokenWise,
)
from .plans.vision_language import IMAGES, VIDEOS, Media, VisionLanguage, register_vision_language
from .plans.vision_split import VisionTower
from .sequence.shard import sequence_positions, shard_sequence, unshard_sequence
from .checkpoint.full_state import full_state_dict
from .recovery import Resumable

__version__ = "0.1.0"

__all__ = [
    "parallelize", "parallelize_model", "parallelize_optimizer", "patch_paddle", "unpatch_paddle", "check_parity",
    "set_mesh", "get_mesh", "SplitPoint",
    "PrepareContextParallel", "Links", "ContextParallel", "TokenWise", "TokenMixer", "register_mixer",
    "register_attention_class", "BlockKind", "register_block_kind", "register_fused_weights", "register_adapter",
    "WeightFormat", "AdapterFormat", "register_weight_format", "RecomputeSetting", "register_recompute_setting",
    "VisionLanguage", "VisionTower", "Media", "IMAGES", "VIDEOS", "register_vision_language", "LossLayer",
    "register_loss_layer",
    "ColWiseParallel", "RowWiseParallel", "ConvParallel", "ExpertParallel",
    "SequenceParallelBegin", "SequenceParallelEnd", "SequenceParallelEnable", "SequenceParallelDisable",
    "SequenceTiled", "OffloadRecomputeInputs",
    "PrepareLayerInput", "PrepareLayerOutput",
    "full_state_dict", "shard_batch", "shard_dataloader", "loss_weight",
    "ring_attention", "ulysses_attention", "hybrid_attention", "attention_work",
    "shard_sequence", "unshard_sequence", "sequence_positions",
    "bytes_sent", "reset_counters", "load_config",
    "save_checkpoint", "load_checkpoint", "wait_checkpoint", "latest_checkpoint", "export_pretrained", "load_pretrained",
    "set_timeout", "get_timeout", "shard_scaler", "Resumable",
]
