"""Which attention calls paddle_cp runs, and the check that a ContextParallel layer's mixing did run.

A call is routed to paddle_cp when the module it names is covered by a
ContextParallel plan (the planned layer or a sublayer: a recomputed attention
is routed too), else when a ContextParallel layer's forward is running (calls
that name no module, or a fresh one as DeepSeek-V3's). Any other call runs the
original function, unless PrepareContextParallel has split the running batch:
then it would attend over this rank's tokens only, and raises. While context
parallelism is paused (check_parity's one-card forward) every call, and every
mixer's, runs the original. A ContextParallel
layer whose forward ends without paddle_cp having run a token mixer (attention,
linear attention, a convolution over the sequence: attention/mixers/) raises: its
mixing went around every adapter and would have seen only this rank's tokens.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

from ... import runtime
from ...activations import recompute
from . import api, batch
from .lengths import agreed_seq_len
from .validation import check_inputs, check_local_length



@dataclass
class Frame:
    plan: object  # the SepRun of the ContextParallel layer (its layout, groups, rotate)
    layer: object
    ran: bool = False


def cover(plan, layer):
    """Route attention calls naming `layer` or any of its sublayers to `plan`."""
    for module in layer.sublayers(include_self=True):
        runtime.installed.planned[module] = plan


def paused():
    """Context parallelism is paused (check_parity's one-card forward): every mixer runs its original."""
    return runtime.state.context_parallel_paused


def enter(plan, layer):
    if not paused():
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
        f"ContextParallel layer {name} ran its forward without paddle_cp computing its attention (or any token "
        "mixer), so each rank attended over its own tokens only. paddle_cp intercepts "
        "paddle.nn.functional.scaled_dot_product_attention and PaddleFormers' ALL_ATTENTION_FUNCTIONS (any "
        "_attn_implementation), looked up at call time, and the mixers of docs/hybrid_models.md: call one of them "
        "from the layer, or call paddle_cp.ring_attention / ulysses_attention yourself; or put ContextParallel on "
        "the layer that computes attention"
    )


def mark_ran():
    """A token mixer ran under context parallelism for every ContextParallel layer now running."""
    for frame in runtime.state.running:
        frame.ran = True


def refuse_unrouted(what):
    """Raise if a split batch is running: an unrouted mixing call would see this rank's tokens only.
    Called by the adapters before they run an original function."""
    if batch.current() is None:
        return
    raise ValueError(
        f"{what} ran outside every ContextParallel layer while PrepareContextParallel had split the sequence, "
        "so it would have mixed this rank's tokens only: put ContextParallel on the layer that makes this call "
        "(e.g. 'model.layers.*.self_attn': pcp.ContextParallel(backend)), see docs/hybrid_models.md"
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
    if paused():
        return None
    plan = runtime.installed.planned.get(module) if module is not None else None
    if plan is None and runtime.state.running:
        plan = runtime.state.running[-1].plan
    return plan


def sequence(plan, local_len):
    """The Batch this rank holds `local_len` tokens of: the running one (PrepareContextParallel's: its split may
    follow its documents), else one over `plan`'s layout of a length agreed with the other ranks (one tiny
    all-gather; shards the script split, which may hold a token more or less); checked against the layout
    on every rank."""
    current = batch.current()
    if current is None:
        seq_len = agreed_seq_len(plan.layout, plan.groups.sep, local_len)
        return batch.Batch(plan.layout, seq_len, group=plan.groups.sep, run=plan)
    if current.pool_groups is not None:
        raise ValueError(
            "PrepareContextParallel(pool=True) lays the global batch out over every dp x sep rank for softmax "
            "attention's ring; this layer's token mixing (linear attention, a convolution over the sequence) is not "
            "supported there: train this model without pool=True")
    check_local_length(current.layout, current.seq_len, current.groups.sep.index, local_len)
    return current


def attend(plan, query, key, value, mask, dropout_p=0.0, training=True, scale=None, enable_gqa=True, sinks=None,
           padding=True):
    """Context-parallel attention of [b, s_local, h, d] q/k/v under `plan` for the current batch: `mask`, the
    call's Mask (api.call_mask), over the batch's documents and, with `padding` (the one-card call carried a
    mask built from it), its padding keys; in the batch's layout over its groups, rotated as `plan` says."""
    check_inputs(query, key, value, dropout_p, training, enable_gqa)
    current = batch.current() or sequence(plan, query.shape[1])  # else shards the script split
    mask = mask.of_batch(current.documents, current.valid if padding else None)
    out = api.attend(current.layout, current.groups, query, key, value, mask, current.seq_len, scale, plan.rotate,
                     sinks)
    mark_ran()
    return out
