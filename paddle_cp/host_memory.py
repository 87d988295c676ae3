"""Host memory where host and device are one (CPU): numpy arrays outside Paddle's allocator, so the allocator's
peak shows the device bytes a GPU would free. Copies are synchronous.

One class for both users of host memory: the recompute inputs kept on the host until their replay
(activations/host_offload.py: `copy_out`/`copy_in`, a Transport there) and the host optimizer's state
(data_parallel/host_optimizer.py: `hold`/`fp32_copy`/`write_back`, counting the bytes a GPU would copy).
"""
from __future__ import annotations

import numpy as np
import paddle

from .comm.counters import nbytes


def _numpy_copy(tensor):
    return np.array(tensor.numpy(), copy=True)


class NumpyHost:
    def __init__(self):
        self.arrays = {}  # data pointer -> the numpy array a host tensor is a view of
        self.counts = {"to_host": 0, "to_host_bytes": 0, "to_device": 0, "to_device_bytes": 0}

    # a recompute call's saved inputs: out after its forward, back for its replay

    def copy_out(self, tensor):
        return _numpy_copy(tensor), None  # (host copy, device tensor to hold until copied)

    def copy_in(self, host):
        return paddle.to_tensor(host)

    def ready(self, handle):
        return True

    def wait(self, handle):
        pass

    # the host optimizer's state: host tensors over the arrays (the kernels write them in place)

    def _wrap(self, array):
        array = np.ascontiguousarray(array)
        tensor = paddle.utils.dlpack.from_dlpack(array)
        self.arrays[tensor.data_ptr()] = array
        return tensor

    def holds(self, tensor):
        return tensor.data_ptr() in self.arrays

    def hold(self, tensor):
        """A host tensor with `tensor`'s value (moved out of the allocator once `tensor` is dropped)."""
        return self._wrap(_numpy_copy(tensor))

    def fp32_copy(self, tensor, keep=False):
        """An fp32 host copy of a device tensor, cast on the device (fp32 bytes over the link); transient unless
        `keep`."""
        fp32 = tensor if tensor.dtype == paddle.float32 else tensor.astype("float32")
        self.counts["to_host"] += 1
        self.counts["to_host_bytes"] += nbytes(fp32)
        return self._to_host(fp32, keep)

    def _to_host(self, fp32, keep):
        array = _numpy_copy(fp32)
        return self._wrap(array) if keep else paddle.utils.dlpack.from_dlpack(array)

    def forget_all_but(self, tensors):
        """Drop the arrays of host tensors the optimizer no longer holds (`set_state_dict` replaced them)."""
        live = {t.data_ptr() for t in tensors}
        self.arrays = {ptr: array for ptr, array in self.arrays.items() if ptr in live}

    def write_back(self, param, host):
        """The new fp32 value into the device parameter, cast to its dtype there (`copy_` writes into the
        parameter's own buffer, on its place)."""
        self.counts["to_device"] += 1
        self.counts["to_device_bytes"] += nbytes(host)
        value = self._to_device(host, param.place)
        param.copy_(value if value.dtype == param.dtype else value.astype(param.dtype), True)

    @staticmethod
    def _to_device(host, place):
        return host  # host and device are one here
