"""Cutting one call's inputs into micro-batches along dim 0."""
from __future__ import annotations

import paddle


def _batch_size(values):
    for v in values:
        if isinstance(v, paddle.Tensor) and v.ndim >= 1:
            return int(v.shape[0])
    raise ValueError("pipeline micro-batching needs at least one tensor input with a batch dim 0")


def split_micro_batches(args, kwargs, labels, m):
    """[(args, kwargs, labels)] for m micro-batches: every tensor whose dim 0 is the batch is cut,
    anything else is passed to each micro-batch whole. ValueError if m does not divide the batch."""
    batch = _batch_size([*args, *kwargs.values(), labels])
    if batch % m:
        raise ValueError(f"pp_config accumulate_steps={m} must divide the batch size {batch}: "
                         "choose accumulate_steps dividing the batch, or a batch size that it divides")
    size = batch // m

    def part(value, i):
        if isinstance(value, paddle.Tensor) and value.ndim >= 1 and int(value.shape[0]) == batch:
            return value[i * size:(i + 1) * size]
        return value
    return [(tuple(part(a, i) for a in args), {k: part(v, i) for k, v in kwargs.items()}, part(labels, i))
            for i in range(m)]
