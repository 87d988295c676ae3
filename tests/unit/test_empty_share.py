"""The loss guard of a rank holding no labelled token (sequence/empty_share.py), on one process: a registered loss
layer's 0/0 becomes a zero with zero gradients, whether no label or no loss_mask entry counts; any other call is
its own result bit for bit."""
import numpy as np
import paddle
import pytest

from paddle_cp import runtime
from paddle_cp.sequence.empty_share import LossLayer, guard_loss_layers, register_loss_layer


class TokenMeanLoss(paddle.nn.Layer):
    """PaddleFormers' criterion in small: the token mean over loss_mask, or over the labelled tokens."""

    ignored_index = -100

    def __init__(self, use_filtered_label_loss=False):
        super().__init__()
        self.use_filtered_label_loss = use_filtered_label_loss  # count by the labels, whatever loss_mask says

    def forward(self, logits, labels, loss_mask=None):
        per_token = paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1), reduction="none",
                                                       ignore_index=self.ignored_index).squeeze(-1)
        filtered = loss_mask is None or self.use_filtered_label_loss
        counted = (labels != self.ignored_index) if filtered else loss_mask
        counted = counted.astype("float32")
        return (per_token * counted).sum() / counted.sum()


@pytest.fixture
def kind():
    kind = LossLayer(__name__, ("TokenMeanLoss",), masks=("loss_mask",), masks_off="use_filtered_label_loss")
    register_loss_layer(kind)
    yield kind
    runtime.installed.loss_layers.remove(kind)


def guarded_loss(use_filtered_label_loss=False):
    layer = TokenMeanLoss(use_filtered_label_loss)
    guard_loss_layers(layer)
    return layer


@pytest.fixture
def guarded(kind):
    return guarded_loss()


def loss_and_grad(layer, labels, loss_mask=None):
    paddle.seed(0)
    logits = paddle.randn([6, 5])
    logits.stop_gradient = False
    loss = layer(logits, paddle.to_tensor(labels), None if loss_mask is None else paddle.to_tensor(loss_mask))
    loss.backward()
    return float(loss), logits.grad.numpy()


@pytest.mark.parametrize("labels, loss_mask", [
    ([-100] * 6, None),  # no labelled token: an image's tokens, a packed row's padding
    ([1, 2, 3, -100, 4, 0], [False] * 6),  # labels, but the loss_mask counts none
    ([-100] * 6, [False] * 6),
])
def test_an_empty_share_is_a_zero_with_zero_gradients(guarded, labels, loss_mask):
    assert np.isnan(loss_and_grad(TokenMeanLoss(), labels, loss_mask)[0])  # unguarded: 0/0
    loss, grad = loss_and_grad(guarded, labels, loss_mask)
    assert loss == 0.0 and not grad.any()


@pytest.mark.parametrize("loss_mask", [None, [True, False, True, True, False, True]])
def test_a_share_with_counted_tokens_is_untouched(guarded, loss_mask):
    labels = [1, 2, 3, -100, 4, 0]
    want, want_grad = loss_and_grad(TokenMeanLoss(), labels, loss_mask)
    got, got_grad = loss_and_grad(guarded, labels, loss_mask)
    assert got == want and np.array_equal(got_grad, want_grad)


def test_a_loss_counting_by_its_labels_alone_ignores_the_loss_mask(kind):
    """use_filtered_label_loss: labels held, a loss_mask counting none is no empty share (the loss ignores it)."""
    labels, loss_mask = [1, 2, 3, -100, 4, 0], [False] * 6
    want, want_grad = loss_and_grad(TokenMeanLoss(True), labels, loss_mask)
    got, got_grad = loss_and_grad(guarded_loss(True), labels, loss_mask)
    assert np.isfinite(want) and want != 0.0
    assert got == want and np.array_equal(got_grad, want_grad)
    loss, grad = loss_and_grad(guarded_loss(True), [-100] * 6, [True] * 6)  # no label: empty whatever the mask
    assert loss == 0.0 and not grad.any()
