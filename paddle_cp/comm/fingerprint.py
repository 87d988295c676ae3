"""Exact integer fingerprints of tensors, computed on the device with no host read: ranks
exchange them to learn whether they hold the same values.

Integers, not float sums: every rank (and every device, whatever order its
reduction takes) gets the same number bit for bit. Each element's bits, read as
an int64, are split into two 32-bit halves, each weighted by its flat position
(a permutation or shift changes the result) and reduced modulo a prime before the
sum, so nothing overflows below 2^31 elements. Large tensors are walked in chunks,
so the int64 temporaries stay small.
"""
from __future__ import annotations

import paddle

_PRIME = 2**31 - 1
_LOW = 2**32 - 1
_CHUNK = 1 << 20  # elements per step: a few int64 temporaries of 8 MiB
# bit-identical integer views of float dtypes (paddle.view reinterprets the storage)
_SAME_WIDTH_INT = {paddle.float16: paddle.int16, paddle.bfloat16: paddle.int16, paddle.float32: paddle.int32,
                   paddle.float64: paddle.int64}


def _bits(x):
    """The elements of `x` as integers carrying all their bits, flattened (a view where `x` is contiguous: the
    int64 copy is made a chunk at a time, so a batch's pixel values never have a whole int64 twin)."""
    if not x.is_contiguous():
        x = paddle.assign(x)  # a contiguous copy: Tensor.contiguous() would compact the caller's tensor in place
    x = x.reshape([-1])  # [numel]
    return paddle.view(x, _SAME_WIDTH_INT[x.dtype]) if x.dtype in _SAME_WIDTH_INT else x


def fingerprint(x):
    """An int64 [1] tensor on `x`'s device: the same on every rank holding the same values
    (dtype and shape are the caller's to compare)."""
    bits = _bits(x.detach())
    total = paddle.zeros([1], "int64")
    for start in range(0, max(bits.shape[0], 1), _CHUNK):
        part = bits[start:start + _CHUNK].astype("int64")
        position = paddle.arange(start, start + part.shape[0], dtype="int64")
        low_weight = (position * 40503 + 1) % 65521 + 1  # < 2^17: low * weight < 2^49
        high_weight = (position * 9973 + 7) % 65519 + 1
        low = paddle.bitwise_and(part, paddle.full([], _LOW, "int64"))
        high = paddle.bitwise_and(paddle.bitwise_right_shift(part, paddle.full([], 32, "int64")),
                                  paddle.full([], _LOW, "int64"))
        total = total + ((low * low_weight) % _PRIME + (high * high_weight) % _PRIME).sum().reshape([1])
    return total
