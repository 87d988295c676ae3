"""`patch_paddle()`: Paddle's own intermediate-API calls run paddle_cp, so an unchanged script works.

Afterwards `dist.parallelize`, `parallelize_model` / `parallelize_optimizer` (module
paddle.distributed.auto_parallel.intermediate.parallelize), `dist.shard_dataloader`
and `dist.shard_scaler` are paddle_cp's, in every loaded module that bound Paddle's
function (`paddle.distributed` re-exports them; a script may have imported them by
name already). `unpatch_paddle()` puts every one of those attributes back.
"""
from __future__ import annotations

import sys

import paddle.distributed.auto_parallel.api as paddle_api
import paddle.distributed.auto_parallel.intermediate.parallelize as paddle_parallelize

from ..data_parallel.scaler import shard_scaler
from ..runtime import installed
from ..sequence.batches import shard_dataloader
from .parallelize import parallelize, parallelize_model, parallelize_optimizer


# Paddle's function -> paddle_cp's, by the name modules bind it under
_REPLACEMENTS = {
    "parallelize": (paddle_parallelize.parallelize, parallelize),
    "parallelize_model": (paddle_parallelize.parallelize_model, parallelize_model),
    "parallelize_optimizer": (paddle_parallelize.parallelize_optimizer, parallelize_optimizer),
    "shard_dataloader": (paddle_api.shard_dataloader, shard_dataloader),
    "shard_scaler": (paddle_api.shard_scaler, shard_scaler),
}


def patch_paddle():
    """Route Paddle's parallelize / parallelize_model / parallelize_optimizer / shard_dataloader /
    shard_scaler to paddle_cp wherever a loaded module holds them. Calling it again is harmless
    (it also catches modules imported since)."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, (original, replacement) in _REPLACEMENTS.items():
            if namespace.get(name) is original:
                namespace[name] = replacement
                installed.paddle_patches.append((module, name, original))


def unpatch_paddle():
    """Give back Paddle's own functions everywhere `patch_paddle` replaced them."""
    while installed.paddle_patches:
        module, name, original = installed.paddle_patches.pop()
        module.__dict__[name] = original
