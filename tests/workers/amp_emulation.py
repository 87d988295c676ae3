"""Scoped use of the CPU emulation of Paddle's GPU mixed precision (emulated_amp.py) in workers that also run
fp32: `emulated(True)` patches Paddle for the duration and restores Paddle's own afterwards; `widened` reads a
state dict's bfloat16 arrays (numpy holds them as their uint16 bit patterns) as float32."""
import contextlib

import numpy as np


@contextlib.contextmanager
def emulated(on):
    if not on:
        yield
        return
    import emulated_amp

    undo = []

    def set_attr(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    emulated_amp.install(set_attr)
    emulated_amp.reset()
    try:
        yield
    finally:
        emulated_amp.reset()
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


def widened(state):
    return {k: (v.astype(np.uint32) << 16).view(np.float32) if v.dtype == np.uint16 else v for k, v in state.items()}
