"""A pipeline step without a schedule (no loss known, accumulate_steps 1, one chunk per rank):
the user's own loop, `out = model(x); loss = loss_fn(out, y); loss.backward(); opt.step()`.

The forward runs stage after stage. The last stage returns the model's real output.
Earlier stages return zeros of the same structure and shapes (the last stage sends
the skeleton back along the pipeline), tied to this stage's output, so the user's
`backward()` there receives the true gradient of that output from the next stage and
continues the backward here; their loss value is meaningless. The received
activation passes an identity whose backward sends its gradient to the stage before.
Order on stage s: receive from s-1, forward, send to s+1, skeleton from s+1, skeleton
to s-1; backward: gradient from s+1, then to s-1: a chain, so blocking transfers meet.
"""
from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from ..comm import stage_p2p


class _GradientFromNext(PyLayer):
    """Zeros in the shape of the model's output; the backward receives the gradients of this
    stage's output tensors (`specs`, all floating ones) and returns those its inputs need (`mask`)."""

    @staticmethod
    def forward(ctx, peer, specs, mask, zeros_specs, *outputs):
        ctx.peer, ctx.specs, ctx.mask = peer, specs, mask
        return tuple(stage_p2p.zeros(s) for s in zeros_specs)

    @staticmethod
    def backward(ctx, *unused):
        grads = stage_p2p.recv_tensors(ctx.peer, ctx.specs)
        return tuple(g for g, needed in zip(grads, ctx.mask) if needed)


class _GradientToPrevious(PyLayer):
    """Identity on the received activation; its backward sends the gradient back."""

    @staticmethod
    def forward(ctx, peer, *received):
        ctx.peer = peer
        ctx.shapes = [(t.shape, t.dtype) for t in received]
        return tuple(t.clone() for t in received)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g if g is not None else paddle.zeros(s, d) for g, (s, d) in zip(grads, ctx.shapes)]
        stage_p2p.send_tensors(ctx.peer, grads)
        return tuple(grads)


def _tuple(result):
    """PyLayer.apply returns a lone tensor for a single output."""
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _replace_floats(value, replacements):
    """`value` with its floating tensors replaced, in order."""
    it = iter(replacements)
    skel, tensors = stage_p2p.skeleton(value)
    swapped = iter([next(it) if t.is_floating_point() else t for t in tensors])
    return stage_p2p.fill(skel, lambda spec: next(swapped))


def _tied_zeros(out, skel, nxt):
    """Zeros shaped like the last stage's output; their backward pulls this stage's output gradient."""
    floats = stage_p2p.float_tensors(out)
    needed = [not t.stop_gradient for t in floats]
    wanted = []
    stage_p2p.fill(skel, wanted.append)  # the output's TensorSpecs, in order
    zeros = iter(_tuple(_GradientFromNext.apply(nxt, [stage_p2p.spec_of(t) for t in floats], needed,
                                                [s for s in wanted if s.is_float],
                                                *[t for t, n in zip(floats, needed) if n])))
    return stage_p2p.fill(skel, lambda s: next(zeros) if s.is_float else stage_p2p.zeros(s))


def run_immediate(pipeline, args, kwargs):
    grad, stage, last_stage = paddle.is_grad_enabled(), pipeline.stage, pipeline.plan.stages - 1
    received = None
    if stage > 0:
        previous = pipeline.peers[stage - 1]
        received = stage_p2p.recv_value(previous, requires_grad=grad)
        if grad:
            passed = _GradientToPrevious.apply(previous, *stage_p2p.float_tensors(received))
            received = _replace_floats(received, _tuple(passed))
    out = pipeline.run_chunk(stage, args, kwargs, received)
    if stage == last_stage:
        if stage > 0:  # a pipeline of one stage has no one to tell
            stage_p2p.send_skeleton(pipeline.peers[stage - 1], stage_p2p.skeleton(out)[0])
        return out
    nxt = pipeline.peers[stage + 1]
    stage_p2p.send_value(nxt, out)
    skel = stage_p2p.recv_skeleton(nxt)
    if stage > 0:
        stage_p2p.send_skeleton(pipeline.peers[stage - 1], skel)
    return _tied_zeros(out, skel, nxt) if grad else stage_p2p.fill(skel, stage_p2p.zeros)
