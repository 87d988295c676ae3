"""Routed experts across an expert group: each (token, slot) pair goes to its expert's owner by an
all-to-all with uneven counts, the owner runs its experts on what arrived, the outputs come back by
the mirror all-to-all and are summed per token with the router's weights. No capacity, nothing dropped:
the result is one card's `sum_j w[t, j] * expert_{i[t, j]}(x_t)`.

Sizes of the exchanges come from the routing: the per-expert counts of every position, counted and
all-gathered on the device (a [P, E] int table), are the one host read per MoE layer, the one a dynamic
all-to-all needs. The pairs' order by expert stays on the device; the order of the received rows by
expert, derived from the table on the host, is copied in once (both ways in one tensor), right after
that read has drained the queue.
"""
from __future__ import annotations

import numpy as np
import paddle

from ..comm import autograd as comm_autograd
from ..comm import collectives


def _counts_table(group, flat, num_experts):
    """[P, E] on the host: pairs each position of the group routes to each expert (counted on the device,
    one all-gather of E ints, one read); this position's counts are row group.index."""
    counts = paddle.put_along_axis(paddle.zeros([num_experts], "int64"), flat, paddle.ones_like(flat), 0,
                                   reduce="add")                   # [E]
    return paddle.stack(collectives.all_gather(group, counts, tag="ep_counts")).numpy()


def _expert_major(table, start, stop):
    """Order that puts the rows this position received (source-major: from each source, its rows for
    expert start, start+1, ...) into expert-major order; and the rows per local expert."""
    mine = table[:, start:stop]                                   # [P, L]
    offsets = np.concatenate([[0], np.cumsum(mine.reshape(-1))])[:-1].reshape(mine.shape)
    order = [np.arange(offsets[s, e], offsets[s, e] + mine[s, e]) for e in range(mine.shape[1])
             for s in range(mine.shape[0])]
    order = np.concatenate(order).astype("int64") if order else np.zeros([0], "int64")
    return order, mine.sum(axis=0)


def routed_output(hidden, indices, weights, group, layout, run_experts):
    """hidden [T, H], indices [T, k] (global expert ids), weights [T, k] -> [T, H] in hidden's dtype,
    summed in the weights' dtype. `run_experts(rows, counts)` runs this position's experts on rows sorted
    by expert (`counts[i]` rows for its i-th expert) and returns (outputs [R, H], extra), `extra` a tensor
    to add to the result (a zero that ties idle experts into the graph) or None."""
    tokens, k = indices.shape
    flat = indices.reshape([-1]).astype("int64")                  # [T*k]
    order = paddle.argsort(flat, stable=True)                     # pairs by expert: each owner's rows contiguous
    table = _counts_table(group, flat, layout.num_experts)        # [P, E]
    start, stop = layout.range_of(group.index)
    send = [int(table[group.index, a:b].sum()) for a, b in layout.ranges]
    recv = [int(table[s, start:stop].sum()) for s in range(group.size)]

    token_of_pair = order // k                                    # [T*k]
    rows = paddle.gather(hidden, token_of_pair)                   # [T*k, H], sorted by expert
    received = comm_autograd.all_to_all(rows, group, 0, 0, send, recv, tag="ep_dispatch")   # [R, H], by source
    by_expert, expert_counts = _expert_major(table, start, stop)
    # [2R]: the received rows in expert order, then the inverse (back to source order)
    both = paddle.to_tensor(np.concatenate([by_expert, np.argsort(by_expert)]).astype("int64"))
    to_experts, to_sources = both[:len(by_expert)], both[len(by_expert):]
    outputs, extra = run_experts(paddle.gather(received, to_experts), expert_counts)
    back = paddle.gather(outputs, to_sources)                     # [R, H], by source
    returned = comm_autograd.all_to_all(back, group, 0, 0, recv, send, tag="ep_combine")    # [T*k, H]

    pair_weights = paddle.gather(weights.reshape([-1]), order)    # [T*k]
    weighted = returned.astype(weights.dtype) * pair_weights.unsqueeze(-1)
    out = paddle.zeros([tokens, hidden.shape[-1]], weights.dtype).index_add(token_of_pair, 0, weighted)
    if extra is not None:
        out = out + extra.astype(out.dtype)
    return out.astype(hidden.dtype)
