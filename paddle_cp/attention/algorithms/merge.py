"""Merge partial attention results by their log-sum-exp, in fp32.

out [b, s, h, d], lse [b, h, s]. A query that saw no key in a part has out 0
and lse -inf there; the sigmoid form keeps that finite (weight 0) and stays
exact when one log-sum-exp is far below the other.
"""
import paddle
import paddle.nn.functional as F

from ..kernels.full_precision import fp32_inside


@fp32_inside
def merge(out, lse, block_out, block_lse):
    if out is None:
        return block_out, block_lse
    diff = block_lse - lse
    both_empty = paddle.isinf(lse) & paddle.isinf(block_lse)  # -inf - -inf would be nan
    diff = paddle.where(both_empty, paddle.zeros_like(diff), diff)
    weight = F.sigmoid(diff).transpose([0, 2, 1]).unsqueeze(-1)
    out = out - weight * (out - block_out)
    lse = paddle.maximum(lse, block_lse) + F.softplus(-diff.abs())
    return out, lse
