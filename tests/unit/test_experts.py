"""Expert parallelism's pure parts: the experts each position holds, and the order an owner runs what arrived."""
import numpy as np
import pytest

from paddle_cp.experts.dispatch import _expert_major
from paddle_cp.experts.layout import ExpertLayout


@pytest.mark.parametrize("experts, size", [(8, 4), (5, 4), (6, 4), (5, 2), (128, 3), (3, 3)])
def test_ranges_are_contiguous_cover_every_expert_once_and_differ_by_at_most_one(experts, size):
    layout = ExpertLayout(experts, size)
    ranges = layout.ranges
    assert ranges[0][0] == 0 and ranges[-1][1] == experts
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    lengths = [stop - start for start, stop in ranges]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
    assert [layout.owner(e) for e in range(experts)] == [p for p, n in enumerate(lengths) for _ in range(n)]


def test_more_ranks_than_experts_is_refused():
    with pytest.raises(ValueError, match="degree <= 3"):
        ExpertLayout(3, 4)


def test_received_rows_are_run_expert_by_expert():
    # two sources; this position holds experts 2 and 3; table[s, e]: pairs source s routes to expert e
    table = np.array([[1, 0, 2, 1], [0, 3, 1, 2]])
    order, counts = _expert_major(table, 2, 4)
    # received, source-major: source 0 sent (e2, e2, e3), source 1 sent (e2, e3, e3)
    assert counts.tolist() == [3, 3]
    assert order.tolist() == [0, 1, 3, 2, 4, 5]
    assert _expert_major(np.zeros([2, 4], "int64"), 0, 2)[0].tolist() == []
