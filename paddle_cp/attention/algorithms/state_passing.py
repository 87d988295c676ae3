"""A chunked linear recurrence (the gated delta rule) over a sequence whose runs several ranks hold.

The rule keeps a state S [b, h, dk, dv] per head; token t maps it as S_t = M_t S_{t-1} + k_t u_t^T
(M_t and u_t from k, g, beta and v) and outputs o_t = S_t^T q_t. Every step is linear in the state
and in v, and acts on each column of S alone. So ONE call of the model's own rule on a run, with
values v' = [0 | v] (dk + dv columns) and initial state [I | 0], returns as its final state [A | B]:
the run's transition A [dk, dk] and offset B [dk, dv], so the state leaving it is A S_in + B for any
entering S_in; and as outputs [O_A | o0], so its true outputs are o0 + O_A S_in. A run that starts the
sequence enters with S = 0: a plain call gives its outputs and B.

Across ranks: each rank summarises its runs, one all-gather hands every rank every run's [A | B]
(bytes independent of the sequence length), each rank scans S_in(next) = A S_in + B in global order
up to its own runs and corrects their outputs. Autograd gives the backward, which mirrors it: the
gather's backward sums over the ranks the gradient each took of every summary (a reduce-scatter).
Written over runs of consecutive global positions, so any layout works: rank r's two chunks in the
balanced p2p layout, or the many runs of a per-document one.
The model's rule runs as the model runs it (under the caller's autocast, as on one card); the summaries,
the scan and the corrections are fp32, forward and backward, whatever autocast is on (full_precision.py).
"""
from __future__ import annotations

import numpy as np
import paddle

from ...comm.autograd import gather_summed
from ..kernels.full_precision import fp32_inside
from ..layout.sequence_layout import runs


def run_summary(rule, q, k, v, g, beta, starts_sequence):
    """(o0, O_A or None, A, B) of one run: q/k [b, n, h_k, dk], v [b, n, h, dv], g/beta [b, n, h].

    `rule(q, k, v, g, beta, initial_state=None)` -> (outputs [b, n, h, dv'], final state [b, h, dk, dv'])."""
    b, n, h, dv = v.shape
    dk = k.shape[-1]
    if starts_sequence:  # enters with S = 0: its outputs are final and A never multiplies anything
        out, offset = rule(q, k, v, g, beta)
        return out, None, paddle.zeros([b, h, dk, dk], "float32"), offset.astype("float32")
    values = paddle.concat([paddle.zeros([b, n, h, dk], v.dtype), v], axis=-1)  # [b, n, h, dk + dv]
    identity = paddle.eye(dk, dtype="float32").expand([b, h, dk, dk])
    start = paddle.concat([identity, paddle.zeros([b, h, dk, dv], "float32")], axis=-1)  # [b, h, dk, dk + dv]
    out, state = rule(q, k, values, g, beta, initial_state=start)
    state = state.astype("float32")
    return out[..., dk:], out[..., :dk], state[..., :dk], state[..., dk:]


@fp32_inside
def corrected(out_zero, out_transition, state):
    """o0 + O_A S_in: out_transition [b, n, h, dk], state [b, h, dk, dv] -> [b, n, h, dv] in o0's dtype."""
    corrected = paddle.matmul(out_transition.astype("float32").transpose([0, 2, 1, 3]), state)  # [b, h, n, dv]
    return (out_zero.astype("float32") + corrected.transpose([0, 2, 1, 3])).astype(out_zero.dtype)


@fp32_inside
def entering_states(starts, summaries, last):
    """{run: the state entering it} for the runs starting at `starts` (any order) up to position `last`,
    scanned in global order from S = 0. summaries [runs, b, h, dk, dk + dv]: each run's [A | B]."""
    dk = summaries.shape[-2]
    state = paddle.zeros([*summaries.shape[1:-1], summaries.shape[-1] - dk], "float32")  # [b, h, dk, dv]
    entering = {}
    for j in np.argsort(starts, kind="stable"):
        if starts[j] > last:
            break
        entering[int(j)] = state
        state = paddle.matmul(summaries[int(j), ..., :dk], state) + summaries[int(j), ..., dk:]
    return entering


def recurrence_across(rule, inputs, members, index, group):
    """This member's outputs [b, s_i, h, dv] of the recurrence over the whole sequence.

    `inputs`: this member's (q, k, v, g, beta), sequence on dim 1, in the order of `members[index]`;
    `members[i]`: the global positions ring member i holds (its order); `group`: the ring (member order)."""
    member_runs = [runs(p) for p in members]
    mine, spans = members[index], member_runs[index]
    summaries = [run_summary(rule, *(x[:, a:e] for x in inputs), starts_sequence=int(mine[a]) == 0)
                 for a, e in spans]
    if group.size == 1 and len(spans) == 1 and summaries[0][1] is None:  # the whole sequence here (Ulysses)
        return summaries[0][0]
    # every run's [A | B] in member order: [runs, b, h, dk, dk + dv]
    own = paddle.stack([paddle.concat([a, b], axis=-1) for _, _, a, b in summaries])
    counts = [len(r) for r in member_runs]
    gathered = gather_summed(own, group, 0, counts, tag="state_passing")
    starts = np.concatenate([[int(p[a]) for a, _ in r] for p, r in zip(members, member_runs)])  # [runs], member order
    first_mine = sum(counts[:index])
    entering = entering_states(starts, gathered, last=max(starts[first_mine:first_mine + len(spans)]))
    outputs = []
    for i, (out_zero, out_transition, _, _) in enumerate(summaries):
        outputs.append(out_zero if out_transition is None
                       else corrected(out_zero, out_transition, entering[first_mine + i]))
    out = paddle.concat(outputs, axis=1) if len(outputs) > 1 else outputs[0]
    if all(o is None for _, o, _, _ in summaries):
        # no run here enters with another's state, but the gather's backward is collective: keep it in the graph
        out = out + (gathered * 0).sum().astype(out.dtype)
    return out
