"""A recompute call replays in backward under the batch facts it was made under (single process)."""
import paddle
import pytest
from paddle.distributed.fleet.utils import recompute as fleet_recompute

from paddle_cp.attention import recompute
from paddle_cp.attention import SequenceLayout, context


@pytest.mark.parametrize("reentrant", [True, False])
def test_each_replay_sees_its_own_batch_after_the_forwards_ended(reentrant):
    recompute.install()
    seen = []

    def layer(x):
        seen.append(context.current().seq_len if context.current() else None)
        return paddle.tanh(x) * 2

    losses = []
    for seq_len in (7, 9):  # two forwards of different batches before one backward
        x = paddle.randn([3, 4])
        x.stop_gradient = False
        with context.published(context.SequenceInfo(SequenceLayout("p2p", 2), seq_len)):
            losses.append(fleet_recompute(layer, x, use_reentrant=reentrant).sum())
    assert context.current() is None and seen == [7, 9]
    paddle.add_n(losses).backward()
    assert sorted(seen[2:]) == [7, 9]  # each replay under its own batch, in whatever order backward runs them


def test_nothing_is_wrapped_outside_a_batch():
    def layer(x):
        return x * 2

    assert recompute.with_current_state(layer) is layer
