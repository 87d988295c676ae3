"""Which tokens and heads live on which rank: layouts, causal balance, the Ulysses head split."""
from typing import NamedTuple, Optional

import paddle
import pytest

from paddle_cp.attention.layout.sequence_layout import SequenceLayout
from paddle_cp.attention.masks.block_mask import BlockMask
from paddle_cp.attention.algorithms.ulysses import head_split


def test_p2p_layout_is_paddles_balanced_split():
    layout = SequenceLayout("p2p", 2)
    assert layout.positions(8, 0).tolist() == [0, 1, 6, 7]
    assert layout.positions(8, 1).tolist() == [2, 3, 4, 5]
    assert SequenceLayout("all2all", 2).positions(8, 1).tolist() == [4, 5, 6, 7]


class LayoutCase(NamedTuple):
    backend: str
    world: int
    degree: Optional[int] = None


LAYOUTS = [LayoutCase("p2p", 3), LayoutCase("all2all", 4), LayoutCase("p2p", 1), LayoutCase("hybrid", 4, 2),
           LayoutCase("hybrid", 6, 3)]


@pytest.mark.parametrize("case", LAYOUTS, ids=str)
@pytest.mark.parametrize("length", [24, 25, 31])
def test_shard_then_restore_is_identity(case, length):
    layout = SequenceLayout(*case)
    world = case.world
    x = paddle.arange(2 * length).reshape([2, length])
    parts = paddle.concat([layout.shard(x, 1, r) for r in range(world)], axis=1)
    restored = paddle.index_select(parts, paddle.to_tensor(layout.restore_order(length)), axis=1)
    assert (restored.numpy() == x.numpy()).all()


@pytest.mark.parametrize("case", LAYOUTS, ids=str)
def test_any_length_splits_within_one_token(case):
    layout = SequenceLayout(*case)
    world = case.world
    for length in range(world, 4 * world + 3):
        lengths = layout.lengths(length)
        assert sum(lengths) == length and max(lengths) - min(lengths) <= 1 and min(lengths) >= 1
    with pytest.raises(ValueError, match="at least one token"):
        layout.check_length(world - 1)


def _ring_work(world, length, rank):
    """Query-key pairs rank `rank` computes at each ring step of a causal p2p run."""
    layout = SequenceLayout("p2p", world)
    mine = layout.positions(length, rank)
    work = []
    for step in range(world):
        mask = BlockMask(mine, layout.positions(length, (rank - step) % world), causal=True)
        work.append(sum((q[1] - q[0]) * (k[1] - k[0]) for q in mask.q_runs() for k in mask.k_runs()
                        if mask.classify(q, k) != "none"))
    return work


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_balanced_ring_gives_every_rank_equal_work(world):
    length = 4 * world
    per_rank = [_ring_work(world, length, rank) for rank in range(world)]
    for step in range(1, world):  # half of the other rank's block, whichever rank is asking
        assert {work[step] for work in per_rank} == {(length // world) ** 2 // 2}


def test_heads_that_do_not_divide_split_within_one_kv_head():
    split = head_split(8, 2, 4)  # fewer k/v heads than ranks: each repeated twice
    assert (split.repeat, split.kv_counts, split.q_counts) == (2, [1, 1, 1, 1], [2, 2, 2, 2])
    split = head_split(5, 5, 2)
    assert (split.repeat, split.q_counts) == (1, [3, 2])
    split = head_split(6, 2, 4)  # GQA group 3: repeat 3 to reach 4 ranks
    assert (split.repeat, split.kv_counts, split.q_counts) == (3, [2, 2, 1, 1], [2, 2, 1, 1])
    with pytest.raises(ValueError, match="ulysses_degree <= 3"):
        head_split(3, 1, 4)
