"""Single-process checks of the pieces: layouts, schedules, kernels, dispatch, plan keys, config errors."""
import warnings

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
import pytest

import paddle_cp as pcp
from paddle_cp.attention.kernels import BlockwiseKernel, FlashKernel, choose_kernel_name, local_attention
from paddle_cp.attention.layout import SequenceLayout
from paddle_cp.attention.mask import BlockMask, Documents
from paddle_cp.attention.merge import merge
from paddle_cp.attention.ulysses import head_split
from paddle_cp.comm.p2p import sends_first
from paddle_cp.mesh import needs_pair_groups
from paddle_cp.plan_keys import resolve_plan


def test_p2p_layout_is_paddles_balanced_split():
    layout = SequenceLayout("p2p", 2)
    assert layout.positions(8, 0).tolist() == [0, 1, 6, 7]
    assert layout.positions(8, 1).tolist() == [2, 3, 4, 5]
    assert SequenceLayout("all2all", 2).positions(8, 1).tolist() == [4, 5, 6, 7]


LAYOUTS = [("p2p", 3, None), ("all2all", 4, None), ("p2p", 1, None), ("hybrid", 4, 2), ("hybrid", 6, 3)]


@pytest.mark.parametrize("backend,world,degree", LAYOUTS)
@pytest.mark.parametrize("length", [24, 25, 31])
def test_shard_then_restore_is_identity(backend, world, degree, length):
    layout = SequenceLayout(backend, world, degree)
    x = paddle.arange(2 * length).reshape([2, length])
    parts = paddle.concat([layout.shard(x, 1, r) for r in range(world)], axis=1)
    restored = paddle.index_select(parts, paddle.to_tensor(layout.restore_order(length)), axis=1)
    assert (restored.numpy() == x.numpy()).all()


@pytest.mark.parametrize("backend,world,degree", LAYOUTS)
def test_any_length_splits_within_one_token(backend, world, degree):
    layout = SequenceLayout(backend, world, degree)
    for length in range(world, 4 * world + 3):
        lengths = layout.lengths(length)
        assert sum(lengths) == length and max(lengths) - min(lengths) <= 1 and min(lengths) >= 1
    with pytest.raises(ValueError, match="at least one token"):
        layout.check_length(world - 1)


def _ring_work(world, length, rank):
    """Query-key pairs rank `rank` computes at each ring step of a causal p2p run."""
    layout = SequenceLayout("p2p", world)
    mine = layout.positions(length, rank)
    work = []
    for step in range(world):
        mask = BlockMask(mine, layout.positions(length, (rank - step) % world), causal=True)
        work.append(sum((q[1] - q[0]) * (k[1] - k[0]) for q in mask.q_runs() for k in mask.k_runs()
                        if mask.classify(q, k) != "none"))
    return work


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_balanced_ring_gives_every_rank_equal_work(world):
    length = 4 * world
    per_rank = [_ring_work(world, length, rank) for rank in range(world)]
    for step in range(1, world):  # half of the other rank's block, whichever rank is asking
        assert {work[step] for work in per_rank} == {(length // world) ** 2 // 2}


def test_heads_that_do_not_divide_split_within_one_kv_head():
    assert head_split(8, 2, 4) == head_split(8, 2, 4)
    split = head_split(8, 2, 4)  # fewer k/v heads than ranks: each repeated twice
    assert (split.repeat, split.kv_counts, split.q_counts) == (2, [1, 1, 1, 1], [2, 2, 2, 2])
    split = head_split(5, 5, 2)
    assert (split.repeat, split.q_counts) == (1, [3, 2])
    split = head_split(6, 2, 4)  # GQA group 3: repeat 3 to reach 4 ranks
    assert (split.repeat, split.kv_counts, split.q_counts) == (3, [2, 2, 1, 1], [2, 2, 1, 1])
    with pytest.raises(ValueError, match="ulysses_degree <= 3"):
        head_split(3, 1, 4)


def test_documents_from_ids_positions_and_row_indices_agree():
    ids = np.array([[0, 0, 0, 1, 1, 2, 2, 2]])
    positions = np.array([[0, 1, 2, 0, 1, 0, 1, 2]])
    by_ids, by_positions = Documents.from_ids(ids), Documents.from_position_ids(positions)
    assert by_ids.start.tolist() == by_positions.start.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5]]
    assert by_ids.end.tolist() == by_positions.end.tolist() == [[3, 3, 3, 5, 5, 8, 8, 8]]
    rows = Documents.from_startend_row_indices(paddle.to_tensor(by_ids.end[:, None]))
    assert rows.end.tolist() == by_ids.end.tolist() and rows.causal_only
    with pytest.raises(ValueError, match="causal form"):
        Documents.from_startend_row_indices(np.zeros([1, 1, 8, 2]))


def test_masks_skip_tiles_no_query_sees():
    docs = Documents.from_ids(np.array([[0] * 4 + [1] * 4]))
    mask = BlockMask(np.arange(4, 8), np.arange(0, 4), causal=True, documents=docs)
    assert mask.classify((0, 4), (0, 4)) == "none"  # later document's queries, earlier document's keys
    causal = BlockMask(np.arange(4, 8), np.arange(0, 4), causal=True)
    assert causal.classify((0, 4), (0, 4)) == "all"
    assert BlockMask(np.arange(8), np.arange(8), causal=True).classify((0, 8), (0, 8)) == "diagonal"
    assert FlashKernel.supports(causal) and not FlashKernel.supports(
        BlockMask(np.arange(8), np.arange(8), causal=True, documents=docs))


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

    def attend(keys):
        mask = BlockMask(np.arange(5, 10), keys, causal=True)
        return kernel.forward(q, k[:, keys[0]:keys[-1] + 1], v[:, keys[0]:keys[-1] + 1], mask, 0.5)

    whole, whole_lse = attend(np.arange(10))
    out, lse = merge(*attend(np.arange(4)), *attend(np.arange(4, 10)))
    np.testing.assert_allclose(out.numpy(), whole.numpy(), atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), whole_lse.numpy(), atol=1e-6)
    # queries 5..7 see none of keys 8, 9: output 0, log-sum-exp -inf, and merging keeps the other part exact
    late_out, late_lse = attend(np.arange(8, 10))
    assert np.isneginf(late_lse.numpy()[:, :, :3]).all() and not late_out.numpy()[:, :3].any()
    out, lse = merge(*attend(np.arange(8)), late_out, late_lse)
    np.testing.assert_allclose(out.numpy(), whole.numpy(), atol=1e-6)


def test_kernel_dispatch_rule():
    assert choose_kernel_name(True, paddle.bfloat16, True) == "flash"
    assert choose_kernel_name(True, paddle.float16, True) == "flash"
    assert choose_kernel_name(True, paddle.float32, True) == "blockwise"
    assert choose_kernel_name(True, paddle.bfloat16, False) == "blockwise"
    assert choose_kernel_name(False, paddle.bfloat16, True) == "blockwise"
    assert choose_kernel_name(True, paddle.bfloat16, True, mask_fits_flash=False) == "blockwise"
    assert choose_kernel_name(True, paddle.bfloat16, True, same_head_dims=False) == "blockwise"  # MLA


def test_flash_takes_no_tile_a_window_or_padding_cuts():
    """Tiles a window or padding cuts are neither empty, full nor plain causal: the blockwise kernel's."""
    assert FlashKernel.supports(BlockMask(np.arange(8), np.arange(8), causal=True))
    assert not FlashKernel.supports(BlockMask(np.arange(8), np.arange(8), causal=True, window=3))
    assert FlashKernel.supports(BlockMask(np.arange(8), np.arange(8), causal=True, window=8))  # never bites
    padded = np.ones((1, 8), bool)
    padded[0, 6:] = False
    assert not FlashKernel.supports(BlockMask(np.arange(8), np.arange(8), causal=True, valid=padded))


def test_window_and_padding_visibility():
    """Query i sees key j iff i - w < j <= i (PaddleFormers' sliding mask) and j is not padding."""
    valid = np.ones((2, 10), bool)
    valid[1, 8:] = False
    mask = BlockMask(np.arange(10), np.arange(10), causal=True, window=3, valid=valid)
    seen = mask.tile((0, 10), (0, 10)).numpy()[:, 0]
    i, j = np.arange(10)[:, None], np.arange(10)[None]
    expected = ((j <= i) & (j > i - 3))[None] & valid[:, None, :]
    np.testing.assert_array_equal(seen, expected)
    assert mask.classify((8, 10), (0, 4)) == "none"  # queries 8, 9 see keys 6..9 only


def test_attention_input_errors_name_the_fix():
    from paddle_cp.attention.validation import check_inputs, check_sinks, check_window

    q, kv = paddle.zeros([1, 4, 4, 8]), paddle.zeros([1, 4, 2, 8])
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        check_inputs(q, kv, kv, 0.0, True, enable_gqa=False)
    check_inputs(q, kv, paddle.zeros([1, 4, 2, 6]), 0.0, True)  # MLA: v's head dim may differ
    with pytest.raises(ValueError, match="one logit per query head"):
        check_sinks(paddle.zeros([2]), q)
    with pytest.raises(ValueError, match="is_causal=True"):
        check_window(4, False)


def test_paddleformers_calls_outside_a_plan_run_the_original():
    pytest.importorskip("paddleformers")
    import paddleformers.nn.attention.interface as interface
    from paddle_cp.attention import adapters

    adapters.install()
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
    pytest.importorskip("paddleformers")
    import paddleformers.nn.attention.interface as interface
    from paddle_cp import runtime
    from paddle_cp.attention import adapters, routing

    adapters.install()
    module = paddle.nn.Layer()
    q = paddle.randn([1, 2, 6, 8])
    routing.enter(object(), module)  # as if a ContextParallel layer's forward were running
    try:
        with pytest.raises(ValueError, match="pass them to the layer PrepareContextParallel hooks"):
            interface.ALL_ATTENTION_FUNCTIONS["eager"](
                module, q, q, q, attn_mask_startend_row_indices=paddle.full([1, 1, 6], 6, "int32"), scaling=0.5)
    finally:
        runtime.reset()


def test_runtime_reset_forgets_everything():
    from paddle_cp import runtime
    from paddle_cp.attention import context

    context.publish(context.SequenceInfo(SequenceLayout("p2p", 2), 8))
    runtime.attention_work["computed"] += 5
    runtime.reset()
    assert context.current() is None and pcp.attention_work()["computed"] == 0 and not runtime.running


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
