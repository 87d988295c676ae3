"""Which attention calls paddle_cp runs, and the check that a ContextParallel layer's did run.

A call is routed to paddle_cp when the module it names is covered by a
ContextParallel plan (the planned layer or a sublayer: a recomputed attention
is routed too), else when a ContextParallel layer's forward is running (calls
that name no module, or a fresh one as DeepSeek-V3's). Any other call runs the
original function. A ContextParallel layer whose forward ends without paddle_cp
having run an attention raises: its attention went around every adapter and
would have seen only this rank's tokens.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass

from .. import runtime
from . import recompute
from . import context
from .api import context_parallel_attention


# module -> the ContextParallel plan covering it (configuration, set when the plan is applied)
_planned = weakref.WeakKeyDictionary()


@dataclass
class Frame:
    plan: object  # the ContextParallel plan (its _layout, _groups, rotate)
    layer: object
    ran: bool = False


def cover(plan, layer):
    """Route attention calls naming `layer` or any of its sublayers to `plan`."""
    for module in layer.sublayers(include_self=True):
        _planned[module] = plan


def enter(plan, layer):
    runtime.state.running.append(Frame(plan, layer))


def leave(layer):
    """Pop `layer`'s frame; raise if its forward completed without a context-parallel attention."""
    running = runtime.state.running
    if not running or running[-1].layer is not layer:
        return  # an earlier pre-hook raised before enter(layer): there is no frame of it to pop
    frame = running.pop()
    if frame.ran or sys.exc_info()[1] is not None:  # an error already on its way: do not hide it
        return
    name = f"{type(layer).__name__} ({layer.full_name()})"
    raise ValueError(
        f"ContextParallel layer {name} ran its forward without paddle_cp computing its attention, so each rank "
        "attended over its own tokens only. paddle_cp intercepts paddle.nn.functional.scaled_dot_product_attention "
        "and PaddleFormers' ALL_ATTENTION_FUNCTIONS (any _attn_implementation), looked up at call time: call one of "
        "them from the layer, or call paddle_cp.ring_attention / ulysses_attention yourself; or put ContextParallel "
        "on the layer that computes attention"
    )


@contextlib.contextmanager
def _replaying(frames):
    """The ContextParallel layers that ran a recompute call, running again for its replay in backward
    (their forwards already checked that paddle_cp ran their attention)."""
    running = runtime.state.running
    depth = len(running)
    running.extend(Frame(frame.plan, frame.layer, ran=True) for frame in frames)
    try:
        yield
    finally:
        del running[depth:]


def _capture_running():
    frames = tuple(runtime.state.running)
    return (lambda: _replaying(frames)) if frames else None


recompute.carry(_capture_running)


def plan_for(module=None):
    """The plan a call should run under, or None for the original function."""
    plan = _planned.get(module) if module is not None else None
    if plan is None and runtime.state.running:
        plan = runtime.state.running[-1].plan
    return plan


def _batch(plan):
    info = context.current()
    if info is not None and (info.layout.backend, info.layout.ulysses) != (plan._layout.backend, plan._layout.ulysses):
        raise ValueError(
            f"inputs were split by PrepareContextParallel(backend={info.layout.backend!r}, ulysses_degree="
            f"{info.layout.ulysses}) but ContextParallel uses backend={plan.backend!r}, ulysses_degree="
            f"{plan._layout.ulysses}: give both plans the same backend and ulysses_degree"
        )
    return info


def attend(plan, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, training=True, scale=None,
           enable_gqa=True, window=None, sinks=None):
    """Context-parallel attention of [b, s_local, h, d] q/k/v under `plan` for the current batch
    (its layout, length, documents and padding, published by PrepareContextParallel)."""
    info = _batch(plan)
    layout, seq_len, documents, valid = plan._layout, None, None, None
    if info is not None:  # the batch's layout: its split may follow its documents
        layout, seq_len, documents, valid = info.layout, info.seq_len, info.documents, info.valid
    out = context_parallel_attention(layout, plan._groups, query, key, value, attn_mask, dropout_p,
                                     is_causal, training, scale, seq_len, documents, plan.rotate,
                                     enable_gqa=enable_gqa, window=window, sinks=sinks, valid=valid)
    for frame in runtime.state.running:
        frame.ran = True
    return out
