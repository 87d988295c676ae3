"""fp32 math that a caller's autocast cannot reach.

paddle_cp's own kernels (blockwise attention, merges, the state-passing scan) cast their inputs to fp32 and
compute there. Under `paddle.amp.auto_cast` (what PaddleFormers' Trainer wraps the forward in) Paddle would
cast the inputs of every white-list op (matmul) back to bf16/fp16, and at O2 without type promotion every
op not on the black list: the forward would compute in low precision, while a PyLayer's backward, run by the
autograd engine after the autocast block has closed, computes in fp32 (under a pipeline, whose schedule runs
backward inside the forward, in low precision too). `fp32_inside` turns autocast off for the function's
body, so forward and backward compute alike. It costs no device work: `auto_cast(enable=False)` switches
the tracer's AMP level and op lists on the host, and is given the current AMP dtype, which it records
globally (GradScaler reads it).
"""
from __future__ import annotations

import functools

import paddle
from paddle.amp.auto_cast import amp_global_state


def autocast_off():
    # level O0 takes no op lists (any dtype is accepted); the dtype given is what auto_cast records
    return paddle.amp.auto_cast(enable=False, level="O0", dtype=amp_global_state().amp_dtype)


def fp32_inside(function):
    """`function` run with autocast off."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        with autocast_off():
            return function(*args, **kwargs)
    return run
