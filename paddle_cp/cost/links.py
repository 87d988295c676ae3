"""A layout's predicted step with its k/v exchange priced on the links between ranks (numpy only).

The planned exchange (planned_exchange.py) moves, per forward + backward of one layer, the k/v rows each
ring group's tiles read from each other group (TileCounts.read, exchange_plan.py's counts) twice (forward,
and again in backward) and their gradients home once. At ring step s member r receives the rows of member
r-s's block it reads, both directions, and in backward the gradients of its own rows member r+s read, each
on the link between the two: NVLink within a node, the network across nodes. A step's exchange is in
flight while the step before computes (the next is posted first), so a rank's step is priced as that
pipeline: sum over s of max(its tiles against member r-s's keys, the exchange of step s+1), plus the fixed
cost per rank (tile_cost.RANK_MS). Bytes are those of tile_cost's fit shape (8 k/v heads of 128, bf16;
gradients fp32, rotation.GRAD_DTYPE), as the tiles are; a rank of a hybrid group carries 1/U of the heads,
so of both. Only received bytes are priced: links are full duplex, and what one rank receives another sends.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import numpy as np

from .exchange import link_bytes
from .tiles import FIT_HEAD_DIM, RANK_MS

FIT_KV_HEADS = 8  # the fit's k/v heads (tile_cost: 32 query heads, GQA 4)
KV_ROW_BYTES = FIT_KV_HEADS * FIT_HEAD_DIM * 2 * 2  # one token's k and v, bf16
GRAD_ROW_BYTES = 2 * KV_ROW_BYTES  # their gradients, fp32


class Links(NamedTuple):
    """The links the layout chooser prices exchanges with (PrepareContextParallel(links=...)).

    `ranks_per_node`: consecutive global ranks sharing a node's NVLink; None: PADDLE_LOCAL_SIZE (the
    processes paddle.distributed.launch starts per node), else every rank on one node. `intra_gbps`,
    `inter_gbps`: GB/s a rank receives at within a node (NVLink) and across nodes (its network card); the
    defaults are pcp-plan's (--intra-gbps, --inter-gbps): an H100/H200 node's NVLink and 200 Gb/s a GPU."""

    ranks_per_node: Optional[int] = None
    intra_gbps: float = 300.0
    inter_gbps: float = 25.0

    def check(self):
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise ValueError(f"Links(ranks_per_node={self.ranks_per_node!r}): give a positive int, or None to read "
                             "PADDLE_LOCAL_SIZE")
        if not (self.intra_gbps > 0 and self.inter_gbps > 0):
            raise ValueError(f"Links rates must be positive GB/s, got intra_gbps={self.intra_gbps!r}, "
                             f"inter_gbps={self.inter_gbps!r}")
        return self

    def per_node(self):
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        local = os.environ.get("PADDLE_LOCAL_SIZE", "")
        return int(local) if local.isdigit() and int(local) > 0 else None


class LinkCost:
    """The links of one ring: `nodes[g]`, the node of ring member g's first rank; `ms_per_byte[r, g]` of
    what r receives from g."""

    def __init__(self, nodes, links=Links()):
        self.nodes, self.links = np.asarray(nodes, np.int64), links.check()
        same = self.nodes[:, None] == self.nodes[None, :]
        self.ms_per_byte = np.where(same, 1 / links.intra_gbps, 1 / links.inter_gbps) * 1e-6

    @classmethod
    def of_ranks(cls, member_ranks, links=Links()):
        """`member_ranks[g]`: a global rank of ring member g (its Ulysses group shares its node)."""
        per_node = links.check().per_node()
        nodes = np.zeros(len(member_ranks), np.int64) if per_node is None else np.asarray(member_ranks) // per_node
        return cls(nodes, links)

    @property
    def nodes_spanned(self):
        return len(np.unique(self.nodes))

    def rank_ms(self, counts, ulysses=1):
        """float [R]: each ring group's rank's predicted ms (tile_cost.TileCounts `counts`), exchange included."""
        ring = len(counts.tokens)
        me = np.arange(ring)[:, None]
        steps = np.arange(ring)[None, :]
        source, reader = (me - steps) % ring, (me + steps) % ring  # [R, steps]: keys from, gradients from
        compute = counts.step_ms(ulysses)[me, source]
        kv = counts.read[me, source] * self.ms_per_byte[me, source] * (2 * KV_ROW_BYTES)
        grads = counts.read[reader, me] * self.ms_per_byte[me, reader] * GRAD_ROW_BYTES
        exchange = np.concatenate([(kv + grads)[:, 1:], np.zeros((ring, 1))], axis=1) / ulysses  # step s+1's
        return np.maximum(compute, exchange).sum(axis=1) + RANK_MS

    def received_bytes(self, counts, ulysses=1):
        """int [R]: bytes a rank of each group receives per forward + backward (fit shape)."""
        return link_bytes(counts.read, KV_ROW_BYTES, GRAD_ROW_BYTES).sum(axis=1) // ulysses

    def link_seconds(self, received):
        """float [R]: seconds each member's `received[r, g]` bytes (exchange.link_bytes) take on the links they
        come over, one after the other (a member receives from one other member a ring step)."""
        return (np.asarray(received) * self.ms_per_byte).sum(axis=1) / 1e3

    def by_link(self, received):
        """(within a node, across nodes): int [R] each, the bytes of `received[r, g]` each member receives."""
        same = self.nodes[:, None] == self.nodes[None, :]
        received = np.asarray(received)
        return np.where(same, received, 0).sum(axis=1), np.where(same, 0, received).sum(axis=1)
