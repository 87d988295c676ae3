"""The state-passing algebra of the gated delta rule against the model's own rule on the whole sequence.

Each run of a layout (here the balanced p2p layout of 3 ranks, a 150-token sequence: chunks cross the
rule's 64-token chunks, and a 4-token sequence over 3 ranks: runs of one token) is summarised by ONE call
of PaddleFormers' rule; the scan of the summaries in global order gives every run's entering state; the
corrected outputs and their gradients must equal one call over the whole sequence.
"""
import sys

import numpy as np
import paddle
import pytest
from launcher import WORKERS

from paddle_cp.attention.layout.sequence_layout import SequenceLayout, runs
from paddle_cp.attention.algorithms.state_passing import corrected, entering_states, run_summary

pytest.importorskip("paddleformers")
sys.path.insert(0, str(WORKERS))
from paddleformers_models import stub_gpu_modules  # noqa: E402

stub_gpu_modules()
from paddleformers.transformers.qwen3_next import modeling  # noqa: E402


def _rule(q, k, v, g, beta, initial_state=None):
    return modeling.paddle_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)


def _inputs(seq, heads=3, dk=8, dv=5):
    paddle.seed(seq)
    tensors = [paddle.randn([2, seq, heads, dk]), paddle.randn([2, seq, heads, dk]), paddle.randn([2, seq, heads, dv]),
               -paddle.rand([2, seq, heads]), paddle.rand([2, seq, heads])]
    for t in tensors:
        t.stop_gradient = False
    return tensors


def _across_runs(inputs, layout, seq):
    """Every rank's outputs in token order, computed run by run as recurrence_across does."""
    members = [layout.positions(seq, r) for r in range(layout.world)]
    pieces, summaries, starts = [], [], []
    for positions in members:
        for a, e in runs(positions):
            start = int(positions[a])
            run = [x[:, start:start + e - a] for x in inputs]
            out_zero, out_transition, transition, offset = run_summary(_rule, *run, starts_sequence=start == 0)
            pieces.append((start, out_zero, out_transition))
            summaries.append(paddle.concat([transition, offset], axis=-1))
            starts.append(start)
    entering = entering_states(np.array(starts), paddle.stack(summaries), last=seq)
    outputs = [o0 if oa is None else corrected(o0, oa, entering[j]) for j, (_, o0, oa) in enumerate(pieces)]
    order = np.argsort(starts)
    return paddle.concat([outputs[j] for j in order], axis=1)


@pytest.mark.parametrize("seq, world", [(150, 3), (4, 3)])
def test_runs_summarised_by_the_models_rule_equal_the_whole_sequence(seq, world):
    inputs = _inputs(seq)
    whole, _ = _rule(*inputs)
    cotangent = paddle.randn(whole.shape)
    want = paddle.grad([whole], inputs, [cotangent])
    got_out = _across_runs(inputs, SequenceLayout("p2p", world), seq)
    got = paddle.grad([got_out], inputs, [cotangent])
    np.testing.assert_allclose(got_out.numpy(), whole.numpy(), atol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), atol=1e-5)
