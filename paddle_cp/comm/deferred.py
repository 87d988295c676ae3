"""A device value read on the host one step later, without stalling the step that made it.

`DeferredRead(tensor)` starts a copy of `tensor` into pinned host memory on the current stream and
records an event after it; `result()` (called a step later) waits for that event only, i.e. for
the work queued before the copy (the collective that produced the value), never for the kernels
queued since, and returns the value as numpy. On CPU the tensor is host memory already.
"""
from __future__ import annotations

import paddle


class DeferredRead:
    def __init__(self, tensor):
        if tensor.place.is_gpu_place():
            self._host = tensor._copy_to(paddle.CUDAPinnedPlace(), False)  # async: the stream orders it
            self._ready = paddle.device.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tensor, None

    def result(self):
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.numpy()
