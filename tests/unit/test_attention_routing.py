"""Routing of attention calls: PaddleFormers' functions outside a plan, refused inputs."""
import numpy as np
import paddle
import pytest

pytest.importorskip("paddleformers")


def test_paddleformers_calls_outside_a_plan_run_the_original():
    import paddleformers.nn.attention.interface as interface
    from paddle_cp.attention import adapters

    holder = paddle.nn.Layer()  # patched while it lives
    adapters.install(holder)
    functions = interface.ALL_ATTENTION_FUNCTIONS
    assert "paddle_cp" in functions
    module = paddle.nn.Layer()
    q = paddle.randn([1, 2, 6, 8])  # [b, h, s, d]
    routed, _ = functions["eager"](module, q, q, q, attention_mask=None, scaling=0.5)
    original, _ = functions["eager"].paddle_cp_original(module, q, q, q, attention_mask=None, scaling=0.5)
    np.testing.assert_array_equal(routed.numpy(), original.numpy())
    with pytest.raises(ValueError, match="ContextParallel plan on its attention layers"):
        functions["paddle_cp"](module, q, q, q, scaling=0.5)


def test_startend_indices_reaching_a_routed_attention_are_refused():
    """Packed-document indices must go to the top layer (PrepareContextParallel), not past it."""
    import paddleformers.nn.attention.interface as interface
    from paddle_cp import runtime
    from paddle_cp.attention import adapters
    from paddle_cp.attention.dispatch import routing

    holder = paddle.nn.Layer()  # patched while it lives
    adapters.install(holder)
    module = paddle.nn.Layer()
    q = paddle.randn([1, 2, 6, 8])
    routing.enter(object(), module)  # as if a ContextParallel layer's forward were running
    try:
        with pytest.raises(ValueError, match="pass them to the layer PrepareContextParallel hooks"):
            interface.ALL_ATTENTION_FUNCTIONS["eager"](
                module, q, q, q, attn_mask_startend_row_indices=paddle.full([1, 1, 6], 6, "int32"), scaling=0.5)
    finally:
        runtime.reset()


def test_leave_without_enter_keeps_the_outer_frame():
    """A pre-hook raising before ContextParallel's enter: its always-called leave must not pop
    the frame of an outer ContextParallel layer."""
    from paddle_cp import runtime
    from paddle_cp.attention.dispatch import routing

    outer, inner = paddle.nn.Layer(), paddle.nn.Layer()
    routing.enter(object(), outer)
    try:
        routing.leave(inner)
        assert [frame.layer for frame in runtime.state.running] == [outer]
    finally:
        runtime.reset()
