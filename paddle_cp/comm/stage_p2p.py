"""Stage-to-stage transfers of a pipeline: a layer's output (any nesting of tuples/lists
of tensors) forward, the gradients of its tensors back.

Each transfer is between the two ranks of a pair group (same coordinates on every
other mesh dim), so gloo's per-group message tags line up as long as both sides
issue their sends and receives in the same order, which the schedule guarantees.
A forward transfer first sends the output's skeleton (its nesting and each
tensor's shape and dtype, pickled into a uint8 tensor), unless the receiver knows
it already (the pipeline keeps the skeletons of the batch layout it runs): reading
it costs the receiver a host read, twice.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.distributed as dist

from . import counters
from .watchdog import guard


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple
    dtype: str

    @property
    def is_float(self):
        return self.dtype in ("float16", "bfloat16", "float32", "float64")


def spec_of(tensor):
    return TensorSpec(tuple(tensor.shape), str(tensor.dtype).replace("paddle.", ""))


def zeros(spec):
    return paddle.zeros(list(spec.shape), spec.dtype)


def skeleton(value):
    """`value` with every tensor replaced by its TensorSpec; tensors in order of appearance."""
    if isinstance(value, paddle.Tensor):
        return spec_of(value), [value]
    if isinstance(value, (tuple, list)):
        parts = [skeleton(v) for v in value]
        return type(value)(p[0] for p in parts), [t for p in parts for t in p[1]]
    return value, []


def fill(skel, make):
    """Rebuild a skeleton, each TensorSpec replaced by `make(spec)` in order of appearance."""
    if isinstance(skel, TensorSpec):
        return make(skel)
    if isinstance(skel, (tuple, list)):
        return type(skel)(fill(s, make) for s in skel)
    return skel


def _pair_ranks(pair):
    return tuple(sorted((dist.get_rank(), pair.peer)))


def _send(pair, tensor, tag):
    tensor = tensor.contiguous()
    counters.record(tag, counters.nbytes(tensor))
    with guard(tag, _pair_ranks(pair)):  # a dead peer stage must not hang this one
        dist.send(tensor, dst=pair.peer, group=pair.group)


def _recv(pair, shape, dtype, tag="pp_recv"):
    buffer = paddle.empty(list(shape), dtype)
    with guard(tag, _pair_ranks(pair)):
        dist.recv(buffer, src=pair.peer, group=pair.group)
    return buffer


def send_skeleton(pair, skel, tag="pp_meta"):
    payload = np.frombuffer(pickle.dumps(skel), dtype=np.uint8)
    _send(pair, paddle.to_tensor([payload.size], dtype="int64"), tag)
    _send(pair, paddle.to_tensor(payload), tag)


def recv_skeleton(pair):
    size = int(_recv(pair, [1], "int64").numpy()[0])
    return pickle.loads(_recv(pair, [size], "uint8").numpy().tobytes())  # noqa: S301 - from our own peer


def send_value(pair, value, tag="pp_activation", announce=True):
    """Send a layer output: its skeleton (unless `announce` is False: the receiver knows it), then its tensors."""
    skel, tensors = skeleton(value)
    if announce:
        send_skeleton(pair, skel)
    for t in tensors:
        _send(pair, t.detach(), tag)


def float_tensors(value):
    """The floating-point tensors of a value (what carries gradients), in order of appearance."""
    return [t for t in skeleton(value)[1] if t.is_floating_point()]


def recv_value(pair, requires_grad=False, skel=None):
    """Receive what send_value sent: the same nesting, with fresh tensors; with `requires_grad` its
    floating tensors are leaves that collect their gradient (the one to send back). `skel`: the skeleton
    when this side knows it (the sender did not announce it)."""
    value = fill(recv_skeleton(pair) if skel is None else skel, lambda spec: _recv(pair, spec.shape, spec.dtype))
    for t in float_tensors(value) if requires_grad else ():
        t.stop_gradient = False
    return value


def send_tensors(pair, tensors, tag="pp_gradient"):
    for t in tensors:
        _send(pair, t.detach(), tag)


def recv_tensors(pair, specs):
    """Tensors of the given TensorSpecs, in order (both sides know them)."""
    return [_recv(pair, s.shape, s.dtype) for s in specs]
