"""PaddleFormers on paddle_cp: what the core needs to know about its models, and its Trainer with paddle_cp
underneath (change two imports, keep the script):

    from paddle_cp.integrations.paddleformers import Trainer, TrainingArguments

The parallel flags PaddleFormers users already pass (context_parallel_size,
sep_parallel_size, tensor_model_parallel_size with sequence_parallel, sharding,
pipeline_model_parallel_size) build paddle_cp's mesh and plans; see
docs/paddleformers_trainer.md. Its CLI: `pcp-train` (cli.py, docs/paddleformers_cli.md).

Importing this module registers PaddleFormers' facts with the core (its attention classes and functions,
fused weights, weight files, recomputation settings: models.py, attention.py, weights.py, recompute.py; each
family's MoE block: families/);
`parallelize`, `load_pretrained` and `export_pretrained` import it on meeting a PaddleFormers model
(paddle_cp/libraries.py). PaddleFormers itself is imported only when Trainer or TrainingArguments is asked for.
"""
import paddle_cp as pcp

from . import attention, families, models, recompute, weights

__all__ = ["Trainer", "TrainingArguments"]


def register():
    models.register()
    pcp.register_adapter(attention.ADAPTER, attention.install, attention.uninstall)
    pcp.register_weight_format(weights.WEIGHT_FORMAT)
    pcp.register_recompute_setting(recompute.recompute_setting)
    families.register_all()


register()


def __getattr__(name):
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    if name == "TrainingArguments":
        from .training_args import TrainingArguments

        return TrainingArguments
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
