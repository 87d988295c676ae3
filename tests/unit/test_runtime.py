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
    from paddle_cp.attention import context
    from paddle_cp.attention.layout import SequenceLayout

    context.publish(context.SequenceInfo(SequenceLayout("p2p", 2), 8))
    runtime.state.attention_work["computed"] += 5
    runtime.state.running.append(object())
    runtime.reset()
    assert context.current() is None and pcp.attention_work()["computed"] == 0 and not runtime.state.running
