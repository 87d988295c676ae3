"""Bytes each rank sends, by operation: what benchmarks compare with the analytic minimum."""
import math
from collections import defaultdict

_sent = defaultdict(int)


def record(op, nbytes):
    _sent[op] += int(nbytes)


def bytes_sent(op=None):
    """Bytes this rank sent since the last reset: for one op, or a dict of all."""
    return _sent[op] if op is not None else dict(_sent)


def reset():
    _sent.clear()


def nbytes(tensor):
    return math.prod(tensor.shape) * tensor.element_size()  # from the shape: numel() would read the device
