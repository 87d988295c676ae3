"""A token-wise block (an MLP and what it holds inside) run over the sequence in tiles.

At long lengths a recomputed decoder layer's backward peak is set by its MLP: gate, up, the activation and
their product, four [tokens, intermediate] tensors, 3.5x the hidden width each on Llama-3-8B. A block that acts
on each token alone gives the same rows whether it sees the sequence whole or in tiles, so (as DeepSpeed ALST's
TiledMLP does) the forward runs tile by tile without recording a graph and keeps only the block's input; the
backward replays one tile at a time with its graph, sends that tile's output gradient through it (the block's
parameter gradients accumulate tile by tile, as a recomputed layer's do) and writes the tile's input gradient.
So one tile's intermediates live at a time instead of the whole sequence's; a forward without a graph (a
recomputed layer's first one) runs tile by tile too. The price on a GPU: the block's
forward runs twice (as under recomputation, which it replaces for this block) and tiles x the op launches.

Exact: each output row is the same function of its input row; only the order of floating-point sums over
tiles in the parameter gradients changes (fp32 rounding).
"""
from __future__ import annotations

import contextlib
import math

import paddle
from paddle.autograd import PyLayer
from paddle.base import core, framework

from .replay import replaying


def tile_bounds(rows, tokens):
    """[(start, end)] cutting `rows` rows into tiles of `tokens` (the last one shorter)."""
    return [(start, min(start + tokens, rows)) for start in range(0, rows, tokens)]


def _autocast_now():
    """The auto_cast arguments in force now, so that a tile replayed in backward computes as its forward did."""
    tracer = framework._dygraph_tracer()
    white, black = tracer._get_amp_op_list()
    level = "O2" if tracer._amp_level == core.AmpLevel.O2 else "O1"
    return dict(enable=tracer._amp_level != core.AmpLevel.O0, custom_white_list=white, custom_black_list=black,
                level=level, dtype="float16" if tracer._amp_dtype == "float16" else "bfloat16")


@contextlib.contextmanager
def _rng_state(state):
    """Draw from `state` (a dropout inside the block replays its forward's mask), then resume where it was."""
    resume = paddle.get_rng_state()
    paddle.set_rng_state(state)
    try:
        yield
    finally:
        paddle.set_rng_state(resume)


class _Tiled(PyLayer):
    """`block(x)` over x's tokens in tiles; x: [..., hidden], the block's output [..., out]. `weights`: the trained
    tensors that `layer` (whose forward `block` runs) and its sublayers hold now; the backward replays with leaves
    sharing them, so their gradients sum over the tiles and leave once, through whatever made them (at sharding
    level 3 the fetched copies: one fetch per call and one per backward, however many tiles this rank cuts)."""

    @staticmethod
    def forward(ctx, block, tokens, layer, x, *weights):
        ctx.block, ctx.autocast, ctx.rng = block, _autocast_now(), []
        ctx.slots, ctx.held = _held(layer)
        ctx.bounds = tile_bounds(math.prod(x.shape[:-1]), tokens)
        ctx.save_for_backward(x)
        return _forward_tiles(block, ctx.bounds, x, ctx.rng)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensor()
        rows = x.reshape([-1, x.shape[-1]])
        grad_rows = grad.reshape([-1, grad.shape[-1]])  # [tokens, out]
        dx = paddle.zeros(rows.shape, rows.dtype)
        values = [value if value.stop_gradient else _leaf(value) for value in ctx.held]
        with _holding(ctx.slots, values):
            for (start, end), rng in zip(ctx.bounds, ctx.rng):
                tile = rows[start:end].detach()
                tile.stop_gradient = False
                with paddle.enable_grad(), replaying(), _rng_state(rng), paddle.amp.auto_cast(**ctx.autocast):
                    y = _call(ctx.block, tile, x.ndim)
                with paddle.amp.auto_cast(enable=False):
                    paddle.autograd.backward([y], [grad_rows[start:end].reshape(y.shape)])
                if tile.grad is not None:
                    dx[start:end] = tile.grad
        trained = [value for value in values if not value.stop_gradient]
        return (dx.reshape(x.shape), *[v.grad if v.grad is not None else paddle.zeros_like(v) for v in trained])


def _leaf(value):
    """A leaf sharing `value`'s memory, gathering its gradient over the tiles."""
    leaf = value.detach()
    leaf.stop_gradient = False
    return leaf


def _held(layer):
    """([(sublayer, name)], [tensor]): what `layer` and its sublayers compute with now (at sharding level 3, inside
    the layer's forward, the full copies its fetch unit put in place of the placeholders)."""
    slots = [(holder, name) for holder in layer.sublayers(include_self=True)
             for name, value in holder._parameters.items() if value is not None]
    return slots, [holder._parameters[name] for holder, name in slots]


@contextlib.contextmanager
def _holding(slots, values):
    """The sublayers compute with `values` in `slots`, then get back what they held."""
    before = [holder._parameters[name] for holder, name in slots]
    for (holder, name), value in zip(slots, values):
        holder._parameters[name] = value
    try:
        yield
    finally:
        for (holder, name), value in zip(slots, before):
            holder._parameters[name] = value


def _forward_tiles(block, bounds, x, rng_states):
    """block(x) tile by tile without a graph, written into one output; each tile's RNG state appended."""
    rows = x.reshape([-1, x.shape[-1]])  # [tokens, hidden]: every leading dim is a token
    out = None
    with paddle.no_grad():
        for start, end in bounds:
            rng_states.append(paddle.get_rng_state())
            y = _call(block, rows[start:end], x.ndim)
            if out is None:  # written in place: a concatenation would hold the output twice
                out = paddle.empty([rows.shape[0], y.shape[-1]], y.dtype)
            out[start:end] = y.reshape([end - start, y.shape[-1]])
    return out.reshape([*x.shape[:-1], out.shape[-1]])  # [..., out]


def _call(block, tile, ndim):
    """The block on one tile, given with as many dims as its whole input had ([1, t, hidden] for [b, s, hidden])."""
    y = block(tile.reshape([1] * (ndim - 2) + tile.shape))
    if not isinstance(y, paddle.Tensor):
        raise ValueError(f"SequenceTiled applies to a layer returning one tensor (an MLP), got {type(y).__name__}")
    return y


def run_tiled(block, tokens, x, layer):
    """`block(x)` computed `tokens` rows at a time, `block` computing with `layer`'s parameters; a gradient flows
    to x and to them."""
    if not isinstance(x, paddle.Tensor) or x.ndim < 2:
        raise ValueError(f"SequenceTiled: the layer's input must be a [..., tokens, hidden] tensor, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if not paddle.is_grad_enabled():  # a recomputed layer's first forward: tiles bound its working set too
        return _forward_tiles(block, tile_bounds(math.prod(x.shape[:-1]), tokens), x, [])
    if x.stop_gradient:  # the block's own parameters still need the backward to run
        x = x.detach()
        x.stop_gradient = False
    _, held = _held(layer)
    return _Tiled.apply(block, tokens, layer, x, *[value for value in held if not value.stop_gradient])
