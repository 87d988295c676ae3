"""Models built under `paddle.LazyGuard()`: `parallelize` keeps them uninitialized; the script's own
`for p in model.parameters(): p.initialize()` then gives each rank exactly its part of what one card
gets from the same loop under the same seed.

Each lazy parameter's init function is wrapped: `initialize()` draws the full value with the
parameter's own initializer (so the random state advances as one card's does, also for a
parameter this rank does not keep), cuts this rank's part (`params.local_part`: tensor-parallel
slice, fused parts, level-3 owner, pipeline stage) and keeps only that. At most one full parameter
exists at a time. Replicas need no broadcast: every rank draws the same values, provided the ranks'
random states agree, which `parallelize` checks (initialize() refuses to draw if they did not).
"""
from __future__ import annotations

import pickle

import paddle

from ..comm import collectives
from ..params import is_lazy, local_part, record_of, set_lazy_shape, store_local_value


def _random_states_agree(group):
    """Whether every rank's random state is the same (one small all-gather; every rank gets the same answer)."""
    digests = collectives.gathered_digests(group, pickle.dumps(paddle.get_rng_state()), tag="lazy_random_state")
    return len(set(digests)) == 1


class ShardedInit:
    """A lazy parameter's init function, keeping this rank's part of the full draw."""

    def __init__(self, draw, states_agree):
        self.draw = draw  # Paddle's: fills the parameter it is given with a value of that parameter's shape
        self.states_agree = states_agree

    def __call__(self, param, block=None):
        if not self.states_agree:  # the same answer on every rank: all raise, at their first initialize()
            raise ValueError("the model was built under paddle.LazyGuard() and the ranks' random states differed at "
                             "parallelize: each rank draws every parameter from its own state, so replicas would "
                             "differ. Call paddle.seed(<same seed>) on every rank before building the model")
        record = record_of(param)
        set_lazy_shape(param, record.full_shape)
        self.draw(param, block)  # the full value, drawn as one card draws it
        full = param.detach()  # shares the buffer: freed when the local part replaces it
        store_local_value(param, local_part(param, full))


def defer_initialization(model, group):
    """Whether the model has lazy parameters; if so, ask whether the ranks' random states agree (over `group`,
    every rank; a model whose parameters are all loaded, never drawn, may disagree), record each lazy
    parameter's full shape and wrap its init function (before any plan reshapes it)."""
    lazy = [p for p in model.parameters() if is_lazy(p)]
    states_agree = _random_states_agree(group) if lazy else True
    for param in lazy:
        record_of(param)
        param.set_init_func(ShardedInit(param._init_func, states_agree))
    return bool(lazy)


def _uninitialized(model):
    return [name for name, p in model.named_parameters() if isinstance(getattr(p, "_init_func", None), ShardedInit)]


def require_initialized(model):
    """Refuse a forward while a lazy parameter is uninitialized: on every rank, before any collective
    (first among the model's pre-hooks). Once every parameter is initialized it is not checked again."""
    done = []

    def check(layer, inputs):
        if done:
            return
        uninitialized = _uninitialized(model)
        if uninitialized:
            more = f" and {len(uninitialized) - 3} more" if len(uninitialized) > 3 else ""
            raise ValueError(f"parameters {uninitialized[:3]}{more} of the lazily built model are not initialized: "
                             "call p.initialize() for every parameter (for p in model.parameters(): p.initialize()) "
                             "after parallelize and before the first forward")
        done.append(True)

    model.register_forward_pre_hook(check, prepend=True)
