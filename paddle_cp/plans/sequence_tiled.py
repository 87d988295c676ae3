"""SequenceTiled: a token-wise block (an MLP) computed over the sequence in tiles of `tokens` rows."""
from __future__ import annotations

import functools

from ..activations.sequence_tiles import run_tiled
from ..attention.mixers.registry import claimed_within
from ..experts.blocks import find_moe_block
from ..params import mark_fetch_unit
from ..mesh import mesh_of
from .base import Plan, refuse_param_plan
from .hook_args import first_input


class SequenceTiled(Plan):
    """`{"model.layers.*.mlp": SequenceTiled(tokens=8192)}`: the layer's forward runs `tokens` of this rank's
    tokens at a time and its backward replays one tile at a time (activations/sequence_tiles.py), so one tile's
    intermediates are held instead of the sequence's. For layers that act on each token alone: an MLP (a MoE
    block's shared experts too), not a block that mixes tokens (attention, convolutions) nor a MoE block (its
    routing statistics span the batch)."""

    must_match = True  # a key that names no layer is a mistake, not Paddle's silent no-op

    def __init__(self, tokens):
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(f"SequenceTiled(tokens=...) takes a positive number of tokens per tile, got {tokens!r}")
        self.tokens = tokens

    def check(self, layer, mesh, param_names=()):
        refuse_param_plan(self, param_names)
        mixers = claimed_within(layer)
        if mixers:
            sub, mixer = mixers[0]
            raise ValueError(f"SequenceTiled applies to a layer acting on each token alone (an MLP); "
                             f"{type(layer).__name__} mixes tokens along the sequence ({type(sub).__name__}: "
                             f"{mixer.name}): key its MLP, e.g. 'model.layers.*.mlp'")
        block = find_moe_block(layer)
        if block is not None:
            dense = block.shared_experts()
            fix = (f"key its shared experts, its dense part, instead (e.g. 'model.layers.*.mlp.{dense[0]}')" if dense
                   else "leave it untiled")
            raise ValueError(f"SequenceTiled does not tile a MoE block ({type(layer).__name__}): its router's "
                             f"statistics span the whole batch and its experts run on the rows routed to them; {fix}")

    def apply(self, layer, dims, param_names=()):
        self.check(layer, mesh_of(dims), param_names)
        forward = layer.forward
        tokens = self.tokens

        @functools.wraps(forward)
        def tiled(*args, **kwargs):
            x = first_input(args, kwargs)
            if args:
                return run_tiled(lambda tile: forward(tile, *args[1:], **kwargs), tokens, x, layer)
            name = next(key for key, value in kwargs.items() if value is x)
            return run_tiled(lambda tile: forward(**{**kwargs, name: tile}), tokens, x, layer)

        layer.forward = tiled
        # sharding level 3 fetches the layer's weights once around the tiled call and once for its backward, not
        # per tile: the tile count follows this rank's rows, which differ between the ranks a fetch meets on
        mark_fetch_unit(layer, runs_by_data=False)
        return None
