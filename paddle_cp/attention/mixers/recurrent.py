"""Paddle's recurrent layers (LSTM, GRU, SimpleRNN and RNN/BiRNN over a cell): their state runs
step by step along the sequence, and paddle_cp has no context-parallel form for them, so a plan
that splits the sequence refuses them (routed or not) rather than let each rank run its own tokens.
"""
from __future__ import annotations

import paddle

from .base import TokenMixer

RECURRENT = (paddle.nn.LSTM, paddle.nn.GRU, paddle.nn.SimpleRNN, paddle.nn.RNN, paddle.nn.BiRNN)


class Recurrent(TokenMixer):
    name = "recurrent layer (LSTM/GRU/SimpleRNN/RNN)"
    routable = False

    def claims(self, layer):
        return isinstance(layer, RECURRENT)

    def check(self, layer, layout):
        raise ValueError(
            f"{type(layer).__name__} ({layer.full_name()}) carries its state token by token along the sequence and "
            "paddle_cp has no context-parallel form for it: train this model without context parallelism, run the "
            "recurrence before PrepareContextParallel splits the sequence, or register a mixer for it "
            "(paddle_cp.register_mixer, docs/hybrid_models.md)"
        )
