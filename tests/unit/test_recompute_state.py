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


class _Saving(paddle.autograd.PyLayer):
    """Saves a tensor made in its forward (as ring attention saves the k/v it received) and reads it in backward."""

    @staticmethod
    def forward(ctx, x, made):
        ctx.save_for_backward(made)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        made, = ctx.saved_tensor()
        return grad * made


@pytest.mark.parametrize("reentrant", [True, False])
def test_what_a_recompute_call_saves_is_held_only_briefly_in_both_its_runs(reentrant):
    """Both runs of a recompute call are in_replay(). What the replay saves is read by the backward that follows
    at once; a non-reentrant call's first run saves placeholders, dropped at once; a reentrant call's first run has
    gradients off and saves nothing: saved_only_briefly() says where ring attention may keep the k/v it received.
    Outside a recompute call every layer's would wait for its backward."""
    import weakref

    from paddle_cp.activations.replay import in_replay, replaying, saved_only_briefly

    recompute.install()
    seen, made = [], []

    def layer(x):
        seen.append((in_replay(), saved_only_briefly()))
        made.append(paddle.full([3], 5.0))
        saved = weakref.ref(made[-1])
        y = _Saving.apply(x, made.pop())
        seen.append(saved() is not None)  # still held once the forward saved it
        return y

    x = paddle.ones([3])
    x.stop_gradient = False
    assert not saved_only_briefly()
    y = fleet_recompute(layer, x, use_reentrant=reentrant)
    y.sum().backward()
    first, first_held, replay, _ = seen
    assert first == (True, not reentrant) and replay == (True, True)
    assert not first_held  # the first run holds nothing it saved: no-grad (reentrant) or a placeholder (non-reentrant)
    assert x.grad.numpy().tolist() == [5.0] * 3 and not in_replay()  # the backward read what the replay saved
    with paddle.no_grad():
        with replaying():
            assert not saved_only_briefly()


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_recompute_call_over_two_ring_layers_keeps_their_kv_within_one_limit(reentrant, monkeypatch):
    """A run of a recompute call holds what all its ring calls keep until its backward: with a limit one layer's
    received k/v fit, a call over two layers keeps the first's alone, in both runs alike (a non-reentrant call's
    saved tensors pair up by order), and the next call counts from nothing again."""
    from types import SimpleNamespace

    from paddle_cp import runtime
    from paddle_cp.attention.algorithms import ring
    from paddle_cp.cost import exchange

    recompute.install()
    k = paddle.ones([1, 4, 2, 8])
    group, masks = SimpleNamespace(size=2, index=0), SimpleNamespace(lengths=lambda: [4, 4])
    monkeypatch.setattr(exchange, "REPLAY_HOLD_LIMIT", ring.received_bytes("allgather", k, k, masks))
    seen = []

    def two_layers(x):
        seen.append([ring.keeps_received("allgather", group, k, k, masks) for _ in range(2)])
        return paddle.tanh(x)  # saves its output: a non-reentrant call replays

    for _ in range(2):
        x = paddle.ones([3])
        x.stop_gradient = False
        fleet_recompute(two_layers, x, use_reentrant=reentrant).sum().backward()
    first_run = [False, False] if reentrant else [True, False]  # a reentrant call's first run saves nothing
    assert seen == [first_run, [True, False]] * 2
    assert runtime.state.replay_held == 0 and not ring.keeps_received("allgather", group, k, k, masks)
