"""State that a recomputed function needs again when backward replays it.

Paddle's recompute (`fleet.utils.recompute`, reentrant or not, and the hybrid
`recompute_hybrid`) runs a function in forward and again in backward, after the
state it first ran under is gone: the batch's Batch ends with the top
layer's forward, and ContextParallel's SDPA interception with the attention
layer's. Every recompute call made while such state exists captures it, and its
replay runs under it again, so each call replays with its own batch's facts
(gradient accumulation, several forwards before one backward).

Paddle's `recompute` functions look their PyLayer (or non-reentrant helper) up
in their module at call time, so wrapping those names covers every caller,
however it imported `recompute` (PaddleFormers binds it at import).

A wrapper registered with `around_calls` runs around each whole recompute call in
forward (the pipeline's stage boundaries: a unit of another stage is not recomputed,
and a stage's last unit ends the stage's forward only once the call has returned
its output, with the output's graph). One registered with `around_saving` is told
the call's function, arguments and whether it is the reentrant PyLayer (host offload
of the inputs that call saves).
"""
from __future__ import annotations

import contextlib
import functools
import importlib

from .. import runtime
from .replay import replaying


def carry(capture):
    """Register `capture() -> (() -> context manager) | None`, called at every recompute call."""
    captures = runtime.installed.recompute_captures
    if capture not in captures:
        captures.append(capture)


def around_calls(wrapper):
    """Register `wrapper(run)`, called instead of each recompute call `run()` (once per wrapper)."""
    wrappers = runtime.installed.recompute_wrappers
    if wrapper not in wrappers:
        wrappers.append(wrapper)


def around_saving(wrapper):
    """Register `wrapper(run, function, args, reentrant)`, called instead of each recompute call `run()`."""
    wrappers = runtime.installed.recompute_saving_wrappers
    if wrapper not in wrappers:
        wrappers.append(wrapper)


def _through_wrappers(run, function, args, reentrant):
    for wrapper in runtime.installed.recompute_saving_wrappers:
        run = functools.partial(wrapper, run, function, args, reentrant)
    for wrapper in runtime.installed.recompute_wrappers:
        run = functools.partial(wrapper, run)
    return run()


def with_current_state(function):
    """`function`, run under the carried state as it is now (itself when nothing is carried)."""
    captured = (capture() for capture in runtime.installed.recompute_captures)
    restores = [restore for restore in captured if restore is not None]
    if not restores:
        return function

    @functools.wraps(function)  # recompute binds arguments by the function's signature
    def replay(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for restore in restores:
                stack.enter_context(restore())
            return function(*args, **kwargs)

    return replay


class _CarryingPyLayer:
    """Stands in for a recompute PyLayer whose apply takes the function first."""

    def __init__(self, pylayer):
        self.pylayer = pylayer

    def apply(self, function, *args, **kwargs):
        return _through_wrappers(lambda: self.pylayer.apply(with_current_state(function), *args, **kwargs),
                                 function, args, reentrant=True)


def _carrying(helper):
    @functools.wraps(helper)
    def call(function, *args, **kwargs):
        return _through_wrappers(lambda: helper(with_current_state(function), *args, **kwargs),
                                 function, args, reentrant=False)

    return call


def _capture_replay():
    return replaying


def install():
    """Wrap Paddle's recompute entry points once per process (they stay wrapped: reset keeps them); every call's
    runs are then in_replay() (activations/replay.py)."""
    carry(_capture_replay)
    if runtime.installed.recompute_wrapped:
        return
    # by module path: the package re-exports a function named `recompute` over its module
    plain = importlib.import_module("paddle.distributed.fleet.recompute.recompute")
    hybrid = importlib.import_module("paddle.distributed.fleet.recompute.recompute_hybrid")

    plain.RecomputeFunction = _CarryingPyLayer(plain.RecomputeFunction)
    plain._recompute_without_reentrant = _carrying(plain._recompute_without_reentrant)
    hybrid._HPRecomputeFunction = _CarryingPyLayer(hybrid._HPRecomputeFunction)
    runtime.installed.recompute_wrapped = True
