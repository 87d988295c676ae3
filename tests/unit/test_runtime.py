"""Runtime state lives in one object, cleared by one reset."""
import paddle_cp as pcp
from paddle_cp import runtime
from paddle_cp.comm import counters


def test_reset_clears_every_recorded_fact():
    runtime.reset()
    counters.record("ring", 12)
    counters.record("ring", 4)
    runtime.state.sequence_split = True
    assert pcp.bytes_sent() == {"ring": 16} and counters.bytes_sent(tag="ring") == 16
    runtime.reset()
    assert pcp.bytes_sent() == {} and runtime.state.sequence_split is False


def test_reset_counters_keeps_other_state():
    counters.record("ulysses", 8)
    runtime.state.sequence_split = True
    pcp.reset_counters()
    assert pcp.bytes_sent() == {} and runtime.state.sequence_split is True
    runtime.reset()


def test_reset_forgets_batches_running_layers_and_attention_work():
    from paddle_cp.attention.dispatch import batch as batch_context
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout

    batch_context.publish(batch_context.Batch(SequenceLayout("p2p", 2), 8))
    runtime.state.attention_work["computed"] += 5
    runtime.state.running.append(object())
    runtime.reset()
    assert batch_context.current() is None and pcp.attention_work()["computed"] == 0 and not runtime.state.running


def test_the_sdpa_patch_lasts_while_a_parallelized_layer_lives():
    """adapters.install(layer): F.scaled_dot_product_attention is routed while some holder lives and is
    Paddle's own again once the last is garbage-collected."""
    import gc

    import paddle
    import paddle.nn.functional as F

    from paddle_cp.attention import adapters

    own = F.scaled_dot_product_attention
    first, second = paddle.nn.Layer(), paddle.nn.Layer()
    adapters.install(first)
    adapters.install(second)
    assert F.scaled_dot_product_attention is not own
    del first
    gc.collect()
    assert F.scaled_dot_product_attention is not own  # `second` still needs it
    del second
    gc.collect()
    assert F.scaled_dot_product_attention is own and not runtime.installed.patched("sdpa")


def test_reset_keeps_process_groups_and_refuses_while_a_save_is_written():
    """Process groups are made collectively once per process: reset keeps them (a later parallelize of the
    same ranks reuses them); an async checkpoint save still writing must be waited for first."""
    import pytest

    runtime.installed.groups["probe"] = "group"
    runtime.installed.derived_classes[("probe", int)] = bool
    try:
        runtime.reset()
        assert runtime.installed.groups["probe"] == "group" and not runtime.installed.derived_classes
        runtime.state.pending_save = object()
        with pytest.raises(RuntimeError, match="wait_checkpoint"):
            runtime.reset()
    finally:
        runtime.installed.groups.pop("probe")
        runtime.state.pending_save = None
        runtime.reset()


def test_reset_forgets_io_bytes_and_keeps_registrations_and_the_timeout():
    """Checkpoint I/O bytes are records (reset forgets them); the MoE block kinds and fused-weight rules model
    libraries registered, and the collective timeout the script set, stay."""
    from paddle_cp.checkpoint.io_bytes import count, io_bytes
    from paddle_cp.comm import watchdog
    from paddle_cp.experts.blocks import known_blocks

    blocks, rules = known_blocks(), list(runtime.installed.fused_weight_rules)
    previous = runtime.installed.collective_timeout
    try:
        count("read", 12)
        pcp.set_timeout(7)
        assert io_bytes() == {"read": 12, "written": 0}
        runtime.reset()
        assert io_bytes() == {"read": 0, "written": 0} and watchdog.get_timeout() == 7.0
        assert known_blocks() == blocks and runtime.installed.fused_weight_rules == rules
    finally:
        runtime.installed.collective_timeout = previous
