"""PaddleFormers' Trainer with paddle_cp underneath: change two imports, keep the script.

    from paddle_cp.integrations.paddleformers import Trainer, TrainingArguments

The parallel flags PaddleFormers users already pass (context_parallel_size,
sep_parallel_size, tensor_model_parallel_size with sequence_parallel, sharding,
pipeline_model_parallel_size) build paddle_cp's mesh and plans; see
docs/paddleformers_trainer.md.
"""
from .trainer import Trainer
from .training_args import TrainingArguments

__all__ = ["Trainer", "TrainingArguments"]
