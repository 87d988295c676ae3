"""Token mixers, single process: the registry's claims, what a routed PaddleFormers call computes, refusals
raised before any collective, and attention refused outside every ContextParallel layer while a batch is split."""
import paddle
import pytest

from paddle_cp import runtime
from paddle_cp.attention.dispatch import batch as batch_context
from paddle_cp.attention import mixers
from paddle_cp.attention.layout.sequence_layout import SequenceLayout
from paddle_cp.attention.mixers.gated_delta import _routed_conv, _routed_rule
from paddle_cp.attention.masks.block_mask import Documents


class _Rule(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.conv1d = paddle.nn.Conv1D(4, 4, 3, padding=2, groups=4)
        self.chunk_gated_delta_rule = lambda q, k, v, g, beta, initial_state=None, output_final_state=False, \
            cu_seqlens=None, use_qk_l2norm_in_kernel=False: (v, None)


def test_the_registry_claims_each_kind_once():
    layer = _Rule()
    assert mixers.mixer_of(layer).name.startswith("Gated DeltaNet")
    assert mixers.mixer_of(layer.conv1d).name == "Conv1D over the sequence"
    assert mixers.mixer_of(paddle.nn.LSTM(4, 4)).routable is False
    assert mixers.mixer_of(paddle.nn.Linear(4, 4)) is None
    assert [type(m).__name__ for _, m in mixers.claimed_within(layer)] == ["GatedDeltaNet", "Conv1DOverSequence"]


def test_conv1d_geometries_that_cannot_align_are_refused():
    layout = SequenceLayout("p2p", 2)
    for conv, fix in ((paddle.nn.Conv1D(4, 4, 3, stride=2, padding=2), "use stride 1"),
                      (paddle.nn.Conv1D(4, 4, 3), "pad by 2"),
                      (paddle.nn.Conv1D(4, 4, 3, padding=1, padding_mode="reflect"), "padding_mode='zeros'")):
        with pytest.raises(ValueError, match=fix):
            mixers.check(conv, layout)
    mixers.check(paddle.nn.Conv1D(4, 4, 3, padding="same"), layout)


def test_rule_and_conv_calls_asking_for_document_resets_or_caches_are_refused():
    rule = _routed_rule(_Rule().chunk_gated_delta_rule, plan=None)  # refused before the plan is used
    q = paddle.zeros([1, 4, 2, 8])
    g = paddle.zeros([1, 4, 2])
    for kwargs, why in ((dict(cu_seqlens=paddle.to_tensor([0, 2, 4])), "cu_seqlens"),
                        (dict(initial_state=paddle.zeros([1, 2, 8, 8])), "use_cache=False"),
                        (dict(output_final_state=True), "use_cache=False")):
        with pytest.raises(ValueError, match=why):
            rule(q, q, q, g=g, beta=g, **kwargs)

    def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None):
        return x

    with pytest.raises(ValueError, match="seq_idx"):
        _routed_conv(causal_conv1d_fn, plan=None)(x=paddle.zeros([1, 4, 4]), weight=paddle.zeros([4, 3]),
                                                  seq_idx=paddle.zeros([1, 4], "int32"))


def test_routed_paddleformers_calls_mean_what_one_card_computes():
    from paddle_cp.integrations.paddleformers.attention import one_card_semantics

    module = paddle.nn.Layer()
    local = paddle.zeros([1, 1, 4, 4])
    startend = Documents.from_startend_row_indices(paddle.full([1, 1, 8], 8, "int32"))
    assert one_card_semantics("eager", module, None, None, 8, None) == (False, None, False)  # both ways
    assert one_card_semantics("eager", module, None, True, 8, None)[0] is False  # eager ignores is_causal
    assert one_card_semantics("eager", module, None, None, 8, startend)[0] is True
    assert one_card_semantics("eager", module, local, None, 8, None) == (True, None, True)
    assert one_card_semantics("sdpa", module, None, None, 8, None) == (True, None, False)
    assert one_card_semantics("sdpa", module, None, False, 8, None) == (False, None, False)
    module.is_causal = False
    assert one_card_semantics("flashmask", module, local, None, 8, None) == (False, None, False)


def test_attention_outside_every_plan_while_a_batch_is_split_raises():
    pytest.importorskip("paddleformers")
    import paddleformers.nn.attention.interface as interface
    from paddle_cp.attention import adapters

    holder = paddle.nn.Layer()  # patched while it lives
    adapters.install(holder)
    q = paddle.randn([1, 2, 6, 8])  # [b, h, s, d]
    batch_context.publish(batch_context.Batch(SequenceLayout("p2p", 2), 12))
    try:
        with pytest.raises(ValueError, match="outside every ContextParallel layer"):
            interface.ALL_ATTENTION_FUNCTIONS["eager"](paddle.nn.Layer(), q, q, q, attention_mask=None, scaling=0.5)
        with pytest.raises(ValueError, match="outside every ContextParallel layer"):
            paddle.nn.functional.scaled_dot_product_attention(q, q, q)
    finally:
        runtime.reset()
