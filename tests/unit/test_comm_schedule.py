"""The gloo ring schedule: ordered exchanges never deadlock; pair groups only where gloo's tags need them."""
import numpy as np
import pytest

from paddle_cp.comm.p2p import sends_first
from paddle_cp.mesh import needs_pair_groups


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 8])
def test_ordered_exchange_never_deadlocks(size):
    """Along each cycle of every shift, someone receives first and each sender's target is waiting."""
    for offset in range(1, size):
        first = [sends_first(i, size, offset) for i in range(size)]
        assert not all(first)
        for i in range(size):
            # a rank that sends first must target a rank that receives first, unless the cycle is odd
            cycle = size // np.gcd(size, offset)
            if cycle % 2 == 0:
                assert first[i] != first[(i + offset) % size]


def test_pair_groups_only_where_gloo_tags_need_them():
    assert [needs_pair_groups(n) for n in (1, 2, 3, 4, 6, 8)] == [False, False, True, False, True, False]
