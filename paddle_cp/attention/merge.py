"""Merge partial attention results by their log-sum-exp, in fp32.

out [b, s, h, d], lse [b, h, s]. The sigmoid form stays finite when one of the
two log-sum-exps is far below the other.
"""
import paddle.nn.functional as F


def merge(out, lse, block_out, block_lse):
    if out is None:
        return block_out, block_lse
    weight = F.sigmoid(block_lse - lse).transpose([0, 2, 1]).unsqueeze(-1)
    out = out - weight * (out - block_out)
    lse = lse - F.log_sigmoid(lse - block_lse)
    return out, lse
