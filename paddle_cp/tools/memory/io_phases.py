"""Memory and I/O of one startup or I/O phase on this rank (initialize, load_pretrained, export,
save, load): the peak from Paddle's host allocator statistics (`Allocated`: tensors only), the
model's share on this rank, and the bytes read and written (`checkpoint.io_bytes`).

`peak` counts the model's own tensors and what the phase adds, not other tensors the process
holds (a reference model in a test): the most allocated during the phase, less what was allocated
before it that is not the model. The bound every phase should keep: share + 2 x the largest single
parameter (one full parameter may exist while its slice is cut, never two, never the model).
"""
from __future__ import annotations

import math
import time

from paddle_cp.comm.counters import nbytes

MIB = 2 ** 20


def share_bytes(model, optimizer=None):
    """Bytes of the parameters and buffers this rank holds (its slices; nothing for what others keep), and of
    the optimizer state it keeps."""
    tensors = list(model.state_dict().values())
    if optimizer is not None:
        from paddle_cp.checkpoint.layout import inner_optimizer

        tensors += [t for per_param in inner_optimizer(optimizer)._accumulators.values() for t in per_param.values()]
    unique = {id(t): t for t in tensors}  # a tied weight once
    return sum(nbytes(t) for t in unique.values() if t._is_initialized())


def largest_parameter_bytes(model):
    """Bytes of the largest single-card parameter."""
    from paddle_cp.checkpoint.layout import global_shape

    return max(math.prod(global_shape(p)) * p.element_size() for p in model.parameters())


def measure(phase, run, model=None, optimizer=None):
    """Run `run()` (returns the model, for initialize) and report this rank's phase numbers. `model`
    (and `optimizer`, for checkpoints): already built (I/O phases); their share is not "other" memory."""
    import gc

    from paddle_cp.checkpoint.io_bytes import io_bytes, reset_io_bytes
    from paddle_cp.tools.allocator import allocated, peak, reset_peak

    gc.collect()
    other = allocated() - (share_bytes(model, optimizer) if model is not None else 0)
    reset_peak()
    reset_io_bytes()
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    model = result if model is None else model
    moved = io_bytes()
    return {"phase": phase, "peak": peak() - other, "share": share_bytes(model, optimizer),
            "largest_parameter": largest_parameter_bytes(model), "read": moved["read"],
            "written": moved["written"], "seconds": seconds}


def bound(row):
    """The peak a phase should keep to: its share + 2 x the largest single-card parameter (bytes)."""
    return row["share"] + 2 * row["largest_parameter"]
