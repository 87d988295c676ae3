"""A recompute call replays in backward under the batch facts it was made under (single process)."""
import paddle
import pytest
from paddle.distributed.fleet.utils import recompute as fleet_recompute

from paddle_cp.activations import recompute
from paddle_cp.attention import SequenceLayout
from paddle_cp.attention.dispatch import batch as batch_context


@pytest.mark.parametrize("reentrant", [True, False])
def test_each_replay_sees_its_own_batch_after_the_forwards_ended(reentrant):
    recompute.install()
    seen = []

    def layer(x):
        seen.append(batch_context.current().seq_len if batch_context.current() else None)
        return paddle.tanh(x) * 2

    losses = []
    for seq_len in (7, 9):  # two forwards of different batches before one backward
        x = paddle.randn([3, 4])
        x.stop_gradient = False
        with batch_context.published(batch_context.Batch(SequenceLayout("p2p", 2), seq_len)):
            losses.append(fleet_recompute(layer, x, use_reentrant=reentrant).sum())
    assert batch_context.current() is None and seen == [7, 9]
    paddle.add_n(losses).backward()
    assert sorted(seen[2:]) == [7, 9]  # each replay under its own batch, in whatever order backward runs them


def test_a_whole_model_recompute_shares_one_inputs_check_between_forward_and_replay():
    """Made outside any batch (around a whole model), a recompute call carries one memo into both of its
    runs, so PrepareContextParallel's replayed forward does not check its inputs across ranks again
    (plans/same_batch.py); made inside a model's forward, it carries none."""
    import paddle_cp.plans.same_batch  # noqa: F401 - registers the memo's capture
    from paddle_cp import runtime

    memos = []

    def layer(x):
        memos.append(list(runtime.state.checked_batches))
        return x * 2

    outside = recompute.with_current_state(layer)
    outside(paddle.ones([1]))
    outside(paddle.ones([1]))
    assert len(memos[0]) == 1 and memos[0][0] is memos[1][0]
    with batch_context.published(batch_context.Batch(SequenceLayout("p2p", 2), 5)):
        inside = recompute.with_current_state(layer)
    inside(paddle.ones([1]))
    assert memos[2] == []
