"""Paddle's own per-dtype operator counter: which operators ran, how often, in which dtype."""
from __future__ import annotations

import contextlib

import paddle

DTYPES = ("float16", "bfloat16", "float32", "other")  # the counter's columns


@contextlib.contextmanager
def operator_calls():
    """Yields a dict that holds, once the block ends, {operator: {dtype: calls}} of the operators run in it
    (eager mode; an operator Paddle dispatches to a fused kernel counts once)."""
    calls = {}
    paddle.base.core.clear_low_precision_op_list()
    paddle.set_flags({"FLAGS_low_precision_op_list": 1})
    try:
        yield calls
        for op, counts in paddle.base.core.get_low_precision_op_list().items():  # {op: "fp16,bf16,fp32,other"}
            calls[op] = {dtype: int(n) for dtype, n in zip(DTYPES, counts.split(",")) if int(n)}
    finally:
        paddle.set_flags({"FLAGS_low_precision_op_list": 0})
