"""pcp-selftest's exchanges: the ring shift and the all-to-all timed on this rank, each checked for delivering
what its peers sent."""
from __future__ import annotations

import time


def exchange_bandwidth(group, nbytes, iters, synchronize):
    """{exchange: (bytes this rank sends per exchange, seconds per exchange, delivered)} for the ring shift
    and the all-to-all, each rank sending `nbytes` in all (the all-to-all keeps 1/N of it home)."""
    import paddle
    import paddle.distributed as dist

    from paddle_cp.comm import collectives, p2p

    n, me = group.size, group.index
    elements = max(n, nbytes // 4 // n * n)  # int32: every value below 2^31 is exact (float32's stop at 2^24)
    mine = paddle.full([elements], me, "int32")
    chunks = list(paddle.split(paddle.arange(elements, dtype="int32") + me * elements, n))  # chunk j to position j

    def ring():
        return p2p.shift(group, mine, 1, tag="selftest").wait()

    def all_to_all():
        return collectives.all_to_all(group, chunks, tag="selftest")

    received = ring()
    ring_ok = bool((received == (me - 1) % n).all())
    parts = all_to_all()
    size = elements // n
    expect = [paddle.arange(me * size, (me + 1) * size, dtype="int32") + j * elements for j in range(n)]
    all_to_all_ok = all(bool((got == want).all()) for got, want in zip(parts, expect))

    def seconds(exchange):
        dist.barrier()
        synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            exchange()
        synchronize()
        return (time.perf_counter() - start) / iters

    sent = elements * 4
    return {"ring": (sent if n > 1 else 0, seconds(ring), ring_ok),
            "all_to_all": (sent * (n - 1) // n, seconds(all_to_all), all_to_all_ok)}
