"""Bytes each rank sends and collectives it issues (a point-to-point exchange counts as one), by tag: what
benchmarks compare with the analytic minimum and count per step."""
import contextlib
import math

from paddle.base import core

from ..runtime import state


def record(tag, nbytes):
    state.bytes_sent[tag] += int(nbytes)
    if not state.emulating_collective:
        state.collectives_issued[tag] += 1


@contextlib.contextmanager
def one_collective(tag):
    """The point-to-point rounds that emulate one collective on gloo count as the one collective NCCL issues."""
    state.collectives_issued[tag] += 1
    state.emulating_collective = True
    try:
        yield
    finally:
        state.emulating_collective = False


def bytes_sent(tag=None):
    """Bytes this rank sent since the last reset: for one tag, or a dict of all."""
    return state.bytes_sent[tag] if tag is not None else dict(state.bytes_sent)


def collectives_issued(tag=None):
    """Collectives this rank issued since the last reset: for one tag, or a dict of all."""
    return state.collectives_issued[tag] if tag is not None else dict(state.collectives_issued)


def record_widened_float16(tag):
    state.widened_float16[tag] += 1


def widened_float16(tag=None):
    """float16 all-reduces gloo ran in float32 since the last reset (collectives.py): for one tag, or a dict."""
    return state.widened_float16[tag] if tag is not None else dict(state.widened_float16)


def reset():
    state.bytes_sent.clear()
    state.collectives_issued.clear()
    state.widened_float16.clear()


def nbytes(tensor):
    return math.prod(tensor.shape) * tensor.element_size()  # from the shape: numel() would read the device


def shape_nbytes(shape, dtype):
    """Bytes of a tensor of `shape` and `dtype` that need not exist (a level-3 placeholder's full shape, a
    gradient in its reduction dtype)."""
    return math.prod(shape) * core.size_of_dtype(dtype)
