"""Dtype facts every room shares (imports nothing of the package, so any module may import it)."""
from __future__ import annotations

import paddle

# Half precision: what paddle.amp computes in (decorate(level="O2")'s parameters, autocast's outputs), the only
# dtypes flash kernels take, and the dtypes an fp32 master weight or master gradient stands beside.
LOW_PRECISION = (paddle.float16, paddle.bfloat16)

# Unit roundoff: one rounding of a value to the dtype, relative to its magnitude (bf16 keeps 8 significant bits,
# fp16 11).
ROUNDOFF = {paddle.bfloat16: 2.0 ** -8, paddle.float16: 2.0 ** -11}


def matmul_takes(dtype):
    """Whether this device's matmul takes `dtype` (Paddle's CPU builds register no bfloat16 or float16 matmul)."""
    try:
        x = paddle.ones([2, 2], dtype)
        paddle.matmul(x, x)
        return True
    except (RuntimeError, NotImplementedError, ValueError):
        return False
