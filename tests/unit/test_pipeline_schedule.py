"""Pipeline action lists: every (p, m, v) the issue names runs to the end under gloo's blocking
point-to-point semantics, and computes exactly what a pipeline must, in a valid order.

The simulator is independent of the schedule builder: each rank executes its own list;
a send or receive blocks until the peer's next action is the matching receive or send
(a rendezvous, the strictest model of a blocking transfer); a stall with work left is a deadlock.
"""
import itertools

import pytest

from paddle_cp.pipeline.schedule import BACKWARD, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F, action_lists

MATCH = {SEND_F: RECV_F, SEND_B: RECV_B}


def simulate(lists, p, v):
    """Run the lists; return the order of computes per rank. Fails on deadlock or a use before arrival."""
    last = p * v - 1
    pos = [0] * len(lists)
    have = [set() for _ in lists]  # (kind, virtual, micro) inputs received or produced on this rank
    computed = [[] for _ in lists]
    while any(pos[r] < len(lists[r]) for r in range(len(lists))):
        progressed = False
        for rank, actions in enumerate(lists):
            if pos[rank] == len(actions):
                continue
            a = actions[pos[rank]]
            if a.kind in (FORWARD, BACKWARD):
                if a.kind == FORWARD and a.virtual > 0:
                    assert (FORWARD, a.virtual, a.micro) in have[rank], f"rank {rank} runs {a} before its input"
                if a.kind == BACKWARD:
                    assert (FORWARD, a.virtual, a.micro) in [(k, x.virtual, x.micro) for k, x in computed[rank]]
                    if a.virtual < last:
                        assert (BACKWARD, a.virtual, a.micro) in have[rank], f"rank {rank} runs {a} before its gradient"
                computed[rank].append((a.kind, a))
                pos[rank] += 1
                progressed = True
            elif a.kind in MATCH:
                peer_actions = lists[a.peer]
                if pos[a.peer] == len(peer_actions):
                    continue
                b = peer_actions[pos[a.peer]]
                if b.kind == MATCH[a.kind] and b.peer == rank:
                    target = a.virtual + 1 if a.kind == SEND_F else a.virtual - 1
                    assert (b.virtual, b.micro) == (target, a.micro), f"mismatched transfer {a} -> {b}"
                    assert target % p == a.peer
                    have[a.peer].add((FORWARD if a.kind == SEND_F else BACKWARD, b.virtual, b.micro))
                    pos[rank] += 1
                    pos[a.peer] += 1
                    progressed = True
        if not progressed:
            heads = [lists[r][pos[r]] if pos[r] < len(lists[r]) else None for r in range(len(lists))]
            raise AssertionError(f"deadlock: every rank waits: {heads}")
    return computed


CASES = [(schedule, p, m, v) for p in (2, 3, 4) for m in range(1, 2 * p + 2)
         for schedule, v in (("FThenB", 1), ("1F1B", 1), ("FThenB", 2), ("VPP", 2))]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_every_action_list_runs_to_the_end(schedule, p, m, v):
    lists = action_lists(schedule, p, m, v)
    computed = simulate(lists, p, v)
    for rank in range(p):  # each rank computes exactly its virtual stages, every micro-batch once each way
        want = {(k, c * p + rank, i) for k in (FORWARD, BACKWARD) for c in range(v) for i in range(m)}
        got = [(k, a.virtual, a.micro) for k, a in computed[rank]]
        assert sorted(got) == sorted(want)


@pytest.mark.parametrize("p,m,v", itertools.product((2, 3, 4), (1, 4, 9), (1, 2)))
def test_forward_only_lists_run_to_the_end(p, m, v):
    computed = simulate(action_lists("1F1B", p, m, v, backward=False), p, v)
    assert all(len(c) == m * v for c in computed)


def test_1f1b_keeps_at_most_p_minus_stage_micro_batches_in_flight():
    """What 1F1B is for: stage s holds at most p - s activations, FThenB all m."""
    p, m = 4, 8
    for schedule, bound in (("1F1B", lambda s: p - s), ("FThenB", lambda s: m)):
        for stage, actions in enumerate(action_lists(schedule, p, m)):
            live = peak = 0
            for a in actions:
                live += {FORWARD: 1, BACKWARD: -1}.get(a.kind, 0)
                peak = max(peak, live)
            assert peak == bound(stage), (schedule, stage, peak)


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match="FThenB"):
        action_lists("ZB", 2, 2)


def test_simulator_catches_the_textbook_1f1b_deadlock():
    """The simulator can fail: 1F1B written naively (send each output right after computing it)
    has stage 0 sending micro-batch 1 while stage 1 sends the gradient of micro-batch 0."""
    from paddle_cp.pipeline.schedule import Action
    stage0 = [Action(FORWARD, 0, 0), Action(SEND_F, 0, 0, 1), Action(FORWARD, 0, 1), Action(SEND_F, 0, 1, 1),
              Action(RECV_B, 0, 0, 1), Action(BACKWARD, 0, 0), Action(RECV_B, 0, 1, 1), Action(BACKWARD, 0, 1)]
    stage1 = [Action(RECV_F, 1, 0, 0), Action(FORWARD, 1, 0), Action(BACKWARD, 1, 0), Action(SEND_B, 1, 0, 0),
              Action(RECV_F, 1, 1, 0), Action(FORWARD, 1, 1), Action(BACKWARD, 1, 1), Action(SEND_B, 1, 1, 0)]
    with pytest.raises(AssertionError, match="deadlock"):
        simulate([stage0, stage1], 2, 1)
