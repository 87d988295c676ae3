"""PaddleFormers' Trainer with paddle_cp underneath: change two imports, keep the script.

    from paddle_cp.integrations.paddleformers import Trainer, TrainingArguments

The parallel flags PaddleFormers users already pass (context_parallel_size,
sep_parallel_size, tensor_model_parallel_size with sequence_parallel, sharding,
pipeline_model_parallel_size) build paddle_cp's mesh and plans; see
docs/paddleformers_trainer.md. Its CLI: `pcp-train` (cli.py, docs/paddleformers_cli.md).
What the core needs to know about PaddleFormers' models is registered by models.py, which
`paddle_cp` imports itself: Trainer and TrainingArguments import PaddleFormers only when asked for.
"""
__all__ = ["Trainer", "TrainingArguments"]


def __getattr__(name):
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    if name == "TrainingArguments":
        from .training_args import TrainingArguments

        return TrainingArguments
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
