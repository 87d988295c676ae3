"""fp32 math that a caller's autocast cannot reach.

paddle_cp's own kernels (blockwise attention, merges, the state-passing scan) cast their inputs to fp32 and
compute there. Under `paddle.amp.auto_cast` (what PaddleFormers' Trainer wraps the forward in) Paddle would
cast the inputs of every white-list op (matmul) back to bf16/fp16, and at O2 without type promotion every
op not on the black list: the forward would compute in low precision, while a PyLayer's backward, run by the
autograd engine after the autocast block has closed, computes in fp32 (under a pipeline, whose schedule runs
backward inside the forward, in low precision too). `fp32_inside` turns autocast off for the function's
body, so forward and backward compute alike; only the tracer's level is switched (as `auto_cast` itself
does), none of `auto_cast`'s global state (its dtype, master-gradient hooks) is touched.
"""
from __future__ import annotations

import contextlib
import functools

from paddle.base import core
from paddle.base.framework import _dygraph_tracer


@contextlib.contextmanager
def autocast_off():
    tracer = _dygraph_tracer()
    level = tracer._amp_level
    tracer._amp_level = core.AmpLevel.O0
    try:
        yield
    finally:
        tracer._amp_level = level


def fp32_inside(function):
    """`function` run with autocast off."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        with autocast_off():
            return function(*args, **kwargs)
    return run
