"""Pipeline schedules as per-rank action lists (pure Python, no Paddle).

A schedule first fixes each rank's compute order (FThenB, 1F1B, interleaved 1F1B
for VPP). A tick-by-tick simulation then runs all ranks together, each taking its
next compute action once its input has arrived, and writes one global sequence of
events in which every transfer is a single event right after the compute that
produced it. Each rank's action list is that sequence seen from the rank (a send
on the producer, the matching receive on the consumer). Projections of one
sequence cannot wait on each other forever: when a transfer is reached, both
sides have finished everything before it. So gloo's blocking send/recv always
meet, in the same order on both sides of each stage pair.

Virtual stages: with v chunks per rank, virtual stage j = chunk * p + stage lives
on rank j % p, so a micro-batch visits rank 0, 1, ..., p-1, 0, 1, ... v times.
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("FThenB", "1F1B", "VPP")
FORWARD, BACKWARD = "F", "B"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"


@dataclass(frozen=True)
class Action:
    """`kind` on virtual stage `virtual` for micro-batch `micro`; `peer` is the other rank of a transfer."""

    kind: str
    virtual: int
    micro: int
    peer: int = -1


def _fthenb(m, v):
    forwards = [(FORWARD, c, i) for i in range(m) for c in range(v)]
    return forwards + [(BACKWARD, c, i) for i in range(m) for c in reversed(range(v))]


def _interleaved(stage, p, m, v, warmup):
    """Forwards in groups of p micro-batches per chunk (chunks ascending), backwards likewise with
    chunks descending; `warmup` forwards first, then one forward and one backward, then the rest."""
    groups = [range(g, min(g + p, m)) for g in range(0, m, p)]
    forwards = [(FORWARD, c, i) for group in groups for c in range(v) for i in group]
    backwards = [(BACKWARD, c, i) for group in groups for c in reversed(range(v)) for i in group]
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        order += [f, b]
    return order + backwards[len(forwards) - warmup:]


def compute_order(schedule, stage, p, m, v=1):
    """This rank's forwards and backwards as (kind, chunk, micro-batch), in execution order."""
    if schedule == "FThenB":
        return _fthenb(m, v)
    if schedule == "1F1B" and v == 1:
        return _interleaved(stage, p, m, 1, p - 1 - stage)
    if schedule in ("1F1B", "VPP"):
        return _interleaved(stage, p, m, v, 2 * (p - 1 - stage) + (v - 1) * p)
    raise ValueError(f"unknown schedule_mode {schedule!r}: use one of {list(SCHEDULES)}")


def _forward_only(m, v):
    return [(FORWARD, c, i) for i in range(m) for c in range(v)]


def action_lists(schedule, p, m, v=1, backward=True):
    """One list of Actions per rank (index = stage) for `m` micro-batches on `p` stages of `v` chunks.

    Raises RuntimeError if the compute orders cannot all finish (a schedule bug, not a user error).
    """
    last = p * v - 1
    orders = [list(compute_order(schedule, s, p, m, v) if backward else _forward_only(m, v)) for s in range(p)]
    arrived = set()  # (kind, virtual, micro) whose input this virtual stage has received
    done = set()
    lists = [[] for _ in range(p)]
    positions = [0] * p
    while any(positions[s] < len(orders[s]) for s in range(p)):
        ready = []
        for s in range(p):
            if positions[s] == len(orders[s]):
                continue
            kind, chunk, micro = orders[s][positions[s]]
            virtual = chunk * p + s
            if kind == FORWARD:
                ok = virtual == 0 or (FORWARD, virtual, micro) in arrived
            else:
                ok = (FORWARD, virtual, micro) in done and (virtual == last or (BACKWARD, virtual, micro) in arrived)
            if ok:
                ready.append((s, kind, virtual, micro))
        if not ready:
            raise RuntimeError(f"schedule {schedule} (p={p}, m={m}, v={v}) stalls: {positions}")
        transfers = []
        for s, kind, virtual, micro in ready:  # every rank computes, then the transfers of this tick
            positions[s] += 1
            lists[s].append(Action(kind, virtual, micro))
            done.add((kind, virtual, micro))
            target = virtual + 1 if kind == FORWARD else virtual - 1
            if 0 <= target <= last:
                transfers.append((s, kind, virtual, micro, target))
        for s, kind, virtual, micro, target in transfers:
            peer = target % p
            send, recv = (SEND_F, RECV_F) if kind == FORWARD else (SEND_B, RECV_B)
            lists[s].append(Action(send, virtual, micro, peer))
            lists[peer].append(Action(recv, target, micro, s))
            arrived.add((kind, target, micro))
    return lists
