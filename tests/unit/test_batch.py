"""One batch's facts (attention/dispatch/batch.py): shard_sequence's split follows the last forward's Batch, the
plans' backends agree at check time (single process)."""
import numpy as np
import pytest

import paddle_cp as pcp
from paddle_cp import runtime
from paddle_cp.attention.dispatch import batch as batch_context
from paddle_cp.mesh import MeshGroup
from paddle_cp.plans.context_parallel import check_backends_agree, plan_layout

SEQ = 64
GROUP = MeshGroup((0, 1, 2, 3), 1, None)


def _positions(lengths):
    """[1, SEQ] position ids of packed documents of `lengths` tokens."""
    return np.concatenate([np.arange(n) for n in lengths])[None]


def _forward_batch(plan, positions):
    """The Batch a forward of `plan` over GROUP splits and records, as PrepareContextParallel makes it."""
    documents = plan.documents_of(positions)
    layout = plan.batch_layout(plan_layout(plan, GROUP.ranks), documents)
    made = batch_context.Batch(layout, SEQ, documents, group=GROUP, plan=plan)
    batch_context.record_split(made)
    return made


def test_labels_split_after_the_forward_reuse_its_layout_and_not_another_batchs():
    plan = pcp.PrepareContextParallel("p2p", documents="position_ids")
    positions = _positions([40, 4, 4, 4, 4, 8])
    try:
        forward = _forward_batch(plan, positions)
        assert forward.layout.split.name == "documents"  # packed documents: not the 2N chunks
        labels = plan.shard_batch(GROUP, SEQ, position_ids=positions)
        assert labels.layout is forward.layout and labels.same_documents(forward.documents)
        other = plan.shard_batch(GROUP, SEQ, position_ids=_positions([8] * 8))  # the next batch: chosen for it
        assert other.layout is not forward.layout and not other.same_documents(forward.documents)
        another_plan = pcp.PrepareContextParallel("p2p", documents="position_ids")
        assert another_plan.shard_batch(GROUP, SEQ, position_ids=positions).layout is not forward.layout
    finally:
        runtime.reset()


def test_row_indices_the_plan_split_a_forward_by_are_needed_by_shard_sequence_after_it():
    plan = pcp.PrepareContextParallel("p2p")  # not told of documents: a forward's row indices decide its split
    ends = np.concatenate([np.full(n, start + n) for start, n in ((0, 40), (40, 8), (48, 8), (56, 8))])
    try:
        made = batch_context.Batch(plan.batch_layout(plan_layout(plan, GROUP.ranks), plan.documents_of(
            attn_mask_startend_row_indices=ends[None, None])), SEQ, group=GROUP, plan=plan)
        batch_context.record_split(made)
        assert made.layout.split.name == "documents"
        with pytest.raises(ValueError, match="pass them to shard_sequence too"):
            plan.shard_batch(GROUP, SEQ)
    finally:
        runtime.reset()


def test_a_models_context_parallel_plans_agree_on_their_backend():
    check_backends_agree([pcp.PrepareContextParallel("hybrid", 2), pcp.ContextParallel("hybrid", 2)])
    check_backends_agree([pcp.ContextParallel("p2p"), pcp.ContextParallel("all2all")])  # no split to follow
    with pytest.raises(ValueError, match="same backend and ulysses_degree"):
        check_backends_agree([pcp.PrepareContextParallel("p2p"), pcp.ContextParallel("all2all")])
    with pytest.raises(ValueError, match="ulysses_degree=4: give both"):
        check_backends_agree([pcp.PrepareContextParallel("hybrid", 2), pcp.ContextParallel("hybrid", 4)])
