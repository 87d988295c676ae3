"""The inputs a recomputed layer saves, kept in host memory from its forward until its backward replay.

Under full recomputation a layer keeps only its inputs until backward (its hidden states [tokens, hidden] and
the rotary tables passed to it), but it keeps them for every layer at once: on Llama-3-8B at 475K tokens per
rank, 3.9 GB of hidden states per layer. Paddle's reentrant recompute saves the call's tensor arguments
with `ctx.save_for_backward`; inside a `saved_tensors_hooks` scope around that call, each of those
tensors is copied to host memory as it is saved (pack) and the saved reference becomes the host copy, so the
device buffer is freed as soon as nothing else holds it (the caller's next layer output replaces it). Saved
tensors other than the call's own arguments pass through untouched. In backward, `saved_tensor()` brings the
call's inputs back (unpack), and the call saved just before it, the next layer backward replays, is brought
back ahead of time (prefetch), so on a GPU its copy runs while this layer recomputes.

Where the copies go (`Transport`):
- `NumpyHost` (CPU, paddle_cp/host_memory.py): numpy arrays, outside Paddle's allocator, so the allocator's
  peak shows the device bytes a GPU saves; copies are synchronous and a prefetch is an early copy (the
  prefetched layer's inputs are device bytes from then on, as on a GPU).
- `PinnedHost` (GPU): pinned host tensors; device-to-host copies and prefetches run on a side stream
  (`paddle.device.Stream`, `_copy_to(..., blocking=False)`) ordered by events against the compute stream; a
  device tensor being copied out is held until its event has passed. Not run here: no GPU in this project's
  tests (docs/long_context.md says what is verified where).

Paddle's own `offload_indices` moves the argument's buffer itself to the host (`_share_buffer_to`), which
corrupts a tensor the caller still uses (the rotary tables every layer receives) and on CPU stays inside the
allocator; it is not used.
"""
from __future__ import annotations

import contextlib

import paddle

from .. import runtime
from . import recompute
from ..comm.counters import nbytes
from ..host_memory import NumpyHost
from .recompute_settings import recompute_setting
from .replay import in_replay


class PinnedHost:
    """Pinned host tensors, copied both ways on a side stream (GPU)."""

    def __init__(self):
        self.stream = paddle.device.Stream()
        self.place = paddle.framework._current_expected_place()

    def copy_out(self, tensor):
        self.stream.wait_stream(paddle.device.current_stream())  # the tensor's producer first
        with paddle.device.stream_guard(self.stream):
            host = tensor._copy_to(paddle.CUDAPinnedPlace(), False)
            event = self.stream.record_event()
        return host, (tensor, event)  # the device tensor lives until its copy has run

    def copy_in(self, host):
        self.stream.wait_stream(paddle.device.current_stream())
        with paddle.device.stream_guard(self.stream):
            device = host._copy_to(self.place, False)
            event = self.stream.record_event()
        return _Arriving(device, event)

    def ready(self, handle):
        return handle is None or handle[1].query()

    def wait(self, handle):
        paddle.device.current_stream().wait_event(handle)


class _Arriving:
    """A device tensor whose copy in is still running on the side stream."""

    def __init__(self, tensor, event):
        self.tensor, self.event = tensor, event


def default_transport():
    place = paddle.framework._current_expected_place()
    return PinnedHost() if isinstance(place, paddle.CUDAPlace) else NumpyHost()


class _Saved:
    """One saved tensor in host memory; `device` once it is back (or on its way)."""

    __slots__ = ("host", "nbytes", "stop_gradient", "device", "call")

    def __init__(self, host, nbytes, stop_gradient, call):
        self.host, self.nbytes, self.stop_gradient, self.call = host, nbytes, stop_gradient, call
        self.device = None


class HostCheckpoints:
    """The offloaded inputs of recompute calls, in forward order; counts what moved where."""

    def __init__(self, transport=None):
        self.transport = transport
        self.calls = []  # [[_Saved]] per recompute call still (partly) on the host, forward order
        self.copying_out = []  # device tensors held until their copy to the host has run
        self.host_bytes = self.host_peak = 0
        self.counts = {"offloaded": 0, "prefetched": 0, "fetched_on_demand": 0, "restored": 0}

    @contextlib.contextmanager
    def saving(self, args):
        """Offload the tensors among `args` (tuples of tensors included) that the call saves inside this scope."""
        if self.transport is None:
            self.transport = default_transport()
        ids = {id(t) for arg in args for t in (arg if isinstance(arg, (tuple, list)) else (arg,))
               if isinstance(t, paddle.Tensor) and t.is_floating_point()}  # ids and masks: small, often shared
        call = []
        self.calls.append(call)

        def pack(tensor):
            if id(tensor) not in ids:
                return tensor
            host, pending = self.transport.copy_out(tensor)
            if pending is not None:
                self.copying_out.append(pending)
            saved = _Saved(host, nbytes(tensor), tensor.stop_gradient, call)
            call.append(saved)
            self.host_bytes += saved.nbytes
            self.host_peak = max(self.host_peak, self.host_bytes)
            self.counts["offloaded"] += 1
            return saved

        try:
            with paddle.autograd.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            self._release_copied()
            if not call:
                self.calls.remove(call)

    def _release_copied(self):
        self.copying_out = [p for p in self.copying_out if not self.transport.ready(p)]

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.host is None and saved.device is None:
            raise RuntimeError("an offloaded recompute input was already brought back and released: a second "
                               "backward over the same graph (retain_graph) is not supported with host offload")
        if saved.device is None:
            self._bring_back(saved)
            self.counts["fetched_on_demand"] += 1
        tensor = saved.device
        if isinstance(tensor, _Arriving):
            self.transport.wait(tensor.event)
            tensor = tensor.tensor
        saved.device = None
        tensor.stop_gradient = saved.stop_gradient
        self.counts["restored"] += 1
        earlier = self.calls[:self.calls.index(saved.call)]
        if all(s.host is None and s.device is None for s in saved.call):
            self.calls.remove(saved.call)
        if earlier and any(s.host is not None for s in earlier[-1]):  # the call backward replays next
            for s in earlier[-1]:
                if s.host is not None:
                    self._bring_back(s)
                    self.counts["prefetched"] += 1
        return tensor

    def _bring_back(self, saved):
        saved.device = self.transport.copy_in(saved.host)
        saved.host = None
        self.host_bytes -= saved.nbytes


STORE_ATTR = "_pcp_host_checkpoints"  # on an offloaded layer: the key of the store its calls use


def checkpoints_of(key):
    """The HostCheckpoints the layers offloaded under `key` (their plan) share; kept in runtime, made on first use."""
    stores = runtime.state.host_checkpoints
    if key not in stores:
        stores[key] = HostCheckpoints()
    return stores[key]


def _owner(function):
    """The layer a recompute call runs: the function itself or the layer of a bound method."""
    return function if isinstance(function, paddle.nn.Layer) else getattr(function, "__self__", None)


def _offloading(run, function, args, reentrant):
    key = getattr(_owner(function), STORE_ATTR, None)
    if key is None:
        return run()
    if not reentrant:
        raise ValueError(f"host offload of {type(_owner(function)).__name__}'s recompute inputs needs Paddle's "
                         "reentrant recompute (use_reentrant=True, PaddleFormers' default): the non-reentrant one "
                         "saves each op's tensors itself")
    with checkpoints_of(key).saving(args):
        return run()


def _refuse_unrecomputed(layer, inputs):
    if paddle.is_grad_enabled() and not in_replay():
        setting = recompute_setting(layer)
        raise ValueError(f"{type(layer).__name__} has OffloadRecomputeInputs but ran its forward without "
                         "recomputation (its activations would stay on the device): turn recomputation on "
                         f"{f'({setting.turn_on}) ' if setting is not None else ''}or drop the plan")


def offload_recompute_inputs(layer, key):
    """Keep the inputs of `layer`'s recompute calls in `checkpoints_of(key)`; its forward outside a recompute
    raises."""
    recompute.install()  # its calls' runs are in_replay()
    recompute.around_saving(_offloading)
    setattr(layer, STORE_ATTR, key)
    return layer.register_forward_pre_hook(_refuse_unrecomputed)
