"""Bytes each rank sends, by tag: what benchmarks compare with the analytic minimum."""
import math

from ..runtime import state


def record(tag, nbytes):
    state.bytes_sent[tag] += int(nbytes)


def bytes_sent(tag=None):
    """Bytes this rank sent since the last reset: for one tag, or a dict of all."""
    return state.bytes_sent[tag] if tag is not None else dict(state.bytes_sent)


def reset():
    state.bytes_sent.clear()


def nbytes(tensor):
    return math.prod(tensor.shape) * tensor.element_size()  # from the shape: numel() would read the device
