"""The router's load-balancing statistics over every rank's tokens, as one card sees them.

Qwen2/Qwen3-MoE and gpt-oss add `coef * aux` to the loss when `output_router_logits` is set: aux is
`E * sum_e mean_t(routed to e) * mean_t(router probability of e)` over the layers' router logits of all
tokens of the batch, a product of means, so the mean of per-rank aux losses is not one card's. Each MoE
block's router logits are all-gathered over the dp x sep ranks instead: every rank computes one card's aux
from the whole batch; the gather's backward sums the ranks' gradients (each rank's loss holds the whole
aux once, and gradients are averaged over those ranks), so each router gets one card's gradient.
"""
from __future__ import annotations

import paddle

from ..comm import autograd as comm_autograd
from ..comm import collectives


def gather_router_logits(block_layer, replicas):
    """Make the block's second output (router logits [T, E]) the logits of every rank's tokens."""

    def hook(layer, inputs, output):
        if not isinstance(output, (tuple, list)) or len(output) < 2 or not isinstance(output[1], paddle.Tensor):
            return output
        logits = output[1]
        rows = paddle.to_tensor([logits.shape[0]], dtype="int64")
        sizes = [int(r.numpy()[0]) for r in collectives.all_gather(replicas, rows, tag="ep_router_rows")]
        gathered = comm_autograd.gather_summed(logits, replicas, 0, sizes, tag="ep_router_logits")
        return (output[0], gathered, *output[2:])

    return block_layer.register_forward_post_hook(hook)
