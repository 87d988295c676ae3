"""Single-process checks of the pieces: layouts, schedules, kernels, dispatch, plan keys, config errors."""
import warnings

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
import pytest

import paddle_cp as pcp
from paddle_cp.attention.kernels import BlockwiseKernel, choose_kernel_name, local_attention
from paddle_cp.attention.layout import SequenceLayout
from paddle_cp.attention.merge import merge
from paddle_cp.attention.ring import block_plan
from paddle_cp.comm.p2p import sends_first
from paddle_cp.mesh import needs_pair_groups
from paddle_cp.plan_keys import resolve_plan


def test_p2p_layout_is_paddles_balanced_split():
    layout = SequenceLayout("p2p", 2)
    assert layout.positions(8, 0).tolist() == [0, 1, 6, 7]
    assert layout.positions(8, 1).tolist() == [2, 3, 4, 5]
    assert SequenceLayout("all2all", 2).positions(8, 1).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("backend,world", [("p2p", 3), ("all2all", 4), ("p2p", 1)])
def test_shard_then_restore_is_identity(backend, world):
    layout = SequenceLayout(backend, world)
    x = paddle.arange(2 * 24).reshape([2, 24])
    parts = paddle.concat([layout.shard(x, 1, r) for r in range(world)], axis=1)
    restored = paddle.index_select(parts, paddle.to_tensor(layout.restore_order(24)), axis=1)
    assert (restored.numpy() == x.numpy()).all()


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_balanced_ring_gives_every_rank_equal_work(world):
    length = 4
    for step in range(1, world):
        work = set()
        for rank in range(world):
            (qs, qe), (ks, ke), causal = block_plan(step, rank, world, True, length)
            assert not causal
            work.add((qe - qs) * (ke - ks))
        assert work == {length * length // 2}


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 8])
def test_ordered_exchange_never_deadlocks(size):
    """Along each cycle of every shift, someone receives first and each sender's target is waiting."""
    for offset in range(1, size):
        first = [sends_first(i, size, offset) for i in range(size)]
        assert not all(first)
        for i in range(size):
            # a rank that sends first must target a rank that receives first, unless the cycle is odd
            cycle = size // np.gcd(size, offset)
            if cycle % 2 == 0:
                assert first[i] != first[(i + offset) % size]


def test_pair_groups_only_where_gloo_tags_need_them():
    assert [needs_pair_groups(n) for n in (1, 2, 3, 4, 6, 8)] == [False, False, True, False, True, False]


@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_kernel_matches_sdpa(causal):
    paddle.seed(0)
    q, k, v = paddle.randn([2, 37, 6, 8]), paddle.randn([2, 37, 3, 8]), paddle.randn([2, 37, 3, 8])
    for t in (q, k, v):
        t.stop_gradient = False
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out = local_attention(q, k, v, causal, 8 ** -0.5, BlockwiseKernel(block_size=8))
    grad = paddle.randn(ref.shape)
    for got, want in zip(paddle.grad([out], [q, k, v], [grad]), paddle.grad([ref], [q, k, v], [grad])):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=1e-5)


def test_merge_equals_attention_over_both_blocks():
    paddle.seed(1)
    kernel = BlockwiseKernel()
    q, k, v = paddle.randn([1, 5, 2, 4]), paddle.randn([1, 10, 2, 4]), paddle.randn([1, 10, 2, 4])
    whole, whole_lse = kernel.forward(q, k, v, False, 0.5)
    first = kernel.forward(q, k[:, :4], v[:, :4], False, 0.5)
    second = kernel.forward(q, k[:, 4:], v[:, 4:], False, 0.5)
    out, lse = merge(*first, *second)
    np.testing.assert_allclose(out.numpy(), whole.numpy(), atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), whole_lse.numpy(), atol=1e-6)


def test_kernel_dispatch_rule():
    assert choose_kernel_name(True, paddle.bfloat16, True) == "flash"
    assert choose_kernel_name(True, paddle.float16, True) == "flash"
    assert choose_kernel_name(True, paddle.float32, True) == "blockwise"
    assert choose_kernel_name(True, paddle.bfloat16, False) == "blockwise"
    assert choose_kernel_name(False, paddle.bfloat16, True) == "blockwise"


class Block(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.proj = paddle.nn.Linear(2, 2)


class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.layers = paddle.nn.LayerList([Block(), Block()])
        self.head = paddle.nn.Linear(2, 2)


def test_plan_keys_match_like_paddle():
    plan = pcp.ContextParallel()
    matched = resolve_plan(Net(), {"layers.*.proj": plan, "head.weight": plan, "": plan})
    assert [(name, params) for name, _, _, params in matched] == [
        ("", []), ("layers.0.proj", []), ("layers.1.proj", []), ("head", ["weight"])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_plan(Net(), {"proj": plan}) == []  # fullmatch: "proj" is not "layers.0.proj"
    assert "layers.0.proj" in str(caught[0].message)


def test_bad_configs_fail_before_any_collective():
    mesh = dist.ProcessMesh([0], dim_names=["dp"])
    with pytest.raises(ValueError, match="unknown parallelize config keys"):
        pcp.parallelize(Net(), config={"tp_config": {}}, mesh=mesh)
    with pytest.raises(TypeError, match="paddle_cp plan"):
        pcp.parallelize(Net(), mesh=mesh, config={"cp_config": {"parallelize_plan": {"head": "ContextParallel"}}})
    with pytest.raises(ValueError, match="dim_names"):
        pcp.parallelize(Net(), mesh=mesh, config={"cp_config": {"parallelize_plan": {"head": pcp.ContextParallel()}}})
    with pytest.raises(ValueError, match="given in both"):
        plan = {"parallelize_plan": {"head": pcp.ContextParallel()}}
        pcp.parallelize(Net(), mesh=mesh, config={"mp_config": plan, "cp_config": plan})
    with pytest.raises(ValueError, match="use one of"):
        pcp.PrepareContextParallel(backend="ulysses")
    with pytest.raises(ValueError, match="dims"):
        pcp.ContextParallel().apply(Net(), mesh)


def test_no_config_returns_model_untouched():
    net = Net()
    assert pcp.parallelize(net, None, dist.ProcessMesh([0], dim_names=["sep"]), {})[0] is net
