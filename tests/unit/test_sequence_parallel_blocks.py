"""Paddle's sequence-parallel plan on PaddleFormers models built with their defaults (eager attention),
as on one card: the split waits for the first decoder layer, so the model builds its causal mask and
positions from the whole [b, s, h] embeddings.

SequenceParallelBegin turns the embeddings into [s/mp, b, h] on any mp size, so one
process (mp=1) already shows whether the model sees that shape where it builds them."""
import numpy as np
import paddle
import paddle.distributed as dist
import pytest
from workers.paddleformers_models import build

import paddle_cp as pcp

FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                      use_cache=False)


def _parallelized(family, **overrides):
    from paddle_cp.integrations.paddleformers.plans import tensor_parallel_plan

    paddle.seed(5)
    model = build(family, **overrides)
    reference = build(family, **overrides)
    reference.set_state_dict(model.state_dict())
    mesh = dist.ProcessMesh([0], dim_names=["mp"])
    pcp.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": tensor_parallel_plan(model, True)}})
    return model, reference


def _assert_same(model, reference, **inputs):
    got, want = model(**inputs), reference(**inputs)
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), atol=1e-6)  # loss
    np.testing.assert_allclose(got[1].numpy(), want[1].numpy(), atol=1e-5)  # logits
    got[0].backward()
    want[0].backward()
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads
    for name, param in model.named_parameters():
        np.testing.assert_allclose(param.grad.numpy(), grads[name].numpy(), atol=1e-5, err_msg=name)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3", "phi3"])
def test_default_builds_match_one_card(family):
    pytest.importorskip("paddleformers")
    model, reference = _parallelized(family)
    ids = paddle.randint(0, 128, [2, 12])
    _assert_same(model, reference, input_ids=ids, labels=paddle.randint(0, 128, [2, 12]))


def test_padding_mask_and_full_recompute():
    """A 2-D padding mask reaches the eager mask as on one card; a recomputed first layer splits again."""
    pytest.importorskip("paddleformers")
    model, reference = _parallelized("llama", **FULL_RECOMPUTE)
    model.train(), reference.train()
    mask = paddle.ones([2, 12], "int64")
    mask[1, -3:] = 0
    ids = paddle.randint(0, 128, [2, 12])
    _assert_same(model, reference, input_ids=ids, labels=paddle.randint(0, 128, [2, 12]), attention_mask=mask)


def test_one_begin_plan_splits_each_model_where_its_own_region_starts(monkeypatch):
    """A plan object is a description: the same SequenceParallelBegin on a model whose region starts at its
    blocks waits for them, and on a lone layer splits its output at once."""
    from paddle_cp import runtime
    from paddle_cp.plans.sequence_parallel import split_at_blocks

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.attn = paddle.nn.Linear(4, 4)

        def forward(self, x):
            return self.attn(x)

    class Model(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.embed = paddle.nn.Linear(4, 4)
            self.layers = paddle.nn.LayerList([Block()])

    for name in ("pending_split", "sequence_split", "sequence_whole_shape"):  # restored after, and none pending now
        monkeypatch.setattr(runtime.state, name, None if name == "pending_split" else getattr(runtime.state, name))
    mesh = dist.ProcessMesh([0], dim_names=["mp"])
    begin, disable = pcp.SequenceParallelBegin(), pcp.SequenceParallelDisable()
    model, lone = Model(), paddle.nn.Linear(4, 4)
    applications = [(begin, model.embed, ()), (disable, model.layers[0].attn, ())]
    for plan, layer, _ in applications + [(begin, lone, ())]:
        plan.apply(layer, mesh)
    split_at_blocks(model, applications)
    x = paddle.randn([2, 3, 4])  # [b, s, h]
    assert lone(x).shape == [3, 2, 4] and runtime.state.pending_split is None  # [s/mp, b, h] at once
    assert model.embed(x).shape == [2, 3, 4] and runtime.state.pending_split.shape == (2, 3, 4)  # waits


def test_a_length_mp_does_not_divide_names_the_fix():
    """A sequence (each sep rank's share of it) that the mp ranks cannot split evenly: the error says so and
    what to change, before any collective."""
    from paddle_cp.mesh import MeshGroup
    from paddle_cp.plans.sequence_parallel import _to_split

    two_ranks = MeshGroup(ranks=(0, 1), index=0, group=None)
    with pytest.raises(ValueError, match="this rank's sequence has 7 tokens .* a multiple of 2 .* without "
                                         "sequence_parallel"):
        _to_split(paddle.zeros([1, 7, 4]), two_ranks, need_transpose=True)
