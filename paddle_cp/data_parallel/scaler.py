"""`shard_scaler`: a `paddle.amp.GradScaler` made safe for the optimizer `parallelize` returns.

Paddle's scaler unscales the gradients it finds in `optimizer._param_groups`, decides
"found inf" from them, and then calls `optimizer.step()`, which skips the update when
the flag is set. Run as-is on each rank it would judge this rank's unreduced gradients
(a level-3 rank's stashed gradients not at all) and ranks could disagree: some
stepping, others not. The sharded scaler first reduces the gradients (the optimizer
then does not reduce them again), unscales them, and agrees the flag over the
whole mesh, so every rank skips or every rank steps. A pipeline's schedule runs every
backward inside `model(...)`, before the script's `scaler.scale(loss).backward()`: it scales
each micro-batch's loss by this scaler's scale itself (pipeline/runner.py), so activation
gradients between and inside stages have the scale's underflow protection too.
"""
from __future__ import annotations

import weakref

from paddle.amp import AmpScaler

from .. import runtime
from .optimizer import ParallelOptimizer

_SHARDED = "_pcp_sharded"


def shard_scaler(scaler):
    """Make `scaler` (a paddle.amp.GradScaler) reduce gradients before unscaling and agree on skipping
    over the mesh; returns the same scaler (wrapping it twice does nothing more)."""
    if not isinstance(scaler, AmpScaler):
        raise TypeError(f"shard_scaler takes a paddle.amp.GradScaler, got {type(scaler).__name__}")
    runtime.state.grad_scaler = weakref.ref(scaler)
    if getattr(scaler, _SHARDED, False):
        return scaler
    unscale = scaler._unscale

    def reduce_then_unscale(optimizer):
        if not (scaler._enable and isinstance(optimizer, ParallelOptimizer)):
            return unscale(optimizer)  # disabled (CPU) or a plain optimizer: Paddle's behaviour
        optimizer.keep_gradients_until_step()  # from the next step on; this one's may be reduced already
        optimizer.reduce_gradients()
        unscale(optimizer)
        scaler._found_inf = optimizer.agree_found_inf(scaler._found_inf)
        return None

    scaler._unscale = reduce_then_unscale
    setattr(scaler, _SHARDED, True)
    return scaler
