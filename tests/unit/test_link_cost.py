"""The layout chooser with the k/v exchange priced on the links (cost/links.py): the rows the tile
count says each group reads are the exchange plan's, the vectorised step is the pipeline it describes, and
on the bench's document mixes the link-priced choice is never slower than the choice by tiles alone within
a node, and across nodes never slower than it or 2R chunks (faster where the choice by tiles pays for
bytes)."""
import numpy as np
import pytest

import paddle_cp as pcp
from paddle_cp.cost import packed_layout
from paddle_cp.attention.layout.exchange_plan import ExchangePlan
from paddle_cp.cost.links import GRAD_ROW_BYTES, KV_ROW_BYTES, LinkCost, Links
from paddle_cp.attention.masks.block_mask import Documents
from paddle_cp.cost.tiles import RANK_MS, tile_counts
from paddle_cp.plans.context_parallel import plan_layout
from paddle_cp.tools import packing


def _random_documents(rng, seq, rows):
    ids = np.stack([np.cumsum(rng.rand(seq) < rng.choice([0.002, 0.01, 0.05])) for _ in range(rows)])
    return Documents.from_ids(ids)


def test_rows_read_are_the_exchange_plans():
    """TileCounts.read, counted with the tiles, equals ExchangePlan.counts on every candidate layout of random
    batches (one and two rows, 2-8 groups, uneven blocks)."""
    rng = np.random.RandomState(0)
    checked = 0
    for _ in range(12):
        seq, ring = int(rng.randint(300, 3000)), int(rng.choice([2, 3, 4, 8]))
        documents = _random_documents(rng, seq, int(rng.randint(1, 3)))
        end = np.clip(documents.end, 0, seq)
        for _, groups in packed_layout.candidates(end, documents.keys_seen(), ring, np.arange(ring) // 2):
            counts = tile_counts(groups, end, ring)
            plan = ExchangePlan([np.flatnonzero(groups == g) for g in range(ring)], True, documents)
            assert counts.read.tolist() == plan.counts.tolist()
            checked += int(counts.read.sum() > 0)
    assert checked > 10


def _pipeline_by_hand(counts, link, ulysses):
    """Each rank: sum over ring steps s of max(its tiles against member r-s, step s+1's exchange)."""
    ring = len(counts.tokens)
    tiles = counts.step_ms(ulysses)
    out = []
    for r in range(ring):
        def exchange(s):
            if s >= ring:
                return 0.0
            src, reader = (r - s) % ring, (r + s) % ring
            return (2 * KV_ROW_BYTES * counts.read[r, src] * link.ms_per_byte[r, src]
                    + GRAD_ROW_BYTES * counts.read[reader, r] * link.ms_per_byte[r, reader]) / ulysses
        out.append(sum(max(tiles[r, (r - s) % ring], exchange(s + 1)) for s in range(ring)) + RANK_MS)
    return np.array(out)


@pytest.mark.parametrize("ulysses", [1, 2])
def test_rank_ms_is_the_exchange_pipeline(ulysses):
    rng = np.random.RandomState(1)
    documents = _random_documents(rng, 8192, 1)
    end = np.clip(documents.end, 0, 8192)
    groups = packed_layout.chunk_groups(8192, 4)
    counts = tile_counts(groups, end, 4)
    across = LinkCost([0, 0, 1, 1], Links(intra_gbps=300, inter_gbps=0.5))
    assert np.allclose(across.rank_ms(counts, ulysses), _pipeline_by_hand(counts, across, ulysses))
    assert (across.rank_ms(counts, ulysses) > counts.rank_ms(ulysses) + 1e-9).any()  # slow links show
    fast = LinkCost([0, 0, 0, 0], Links(intra_gbps=1e9))
    assert np.allclose(fast.rank_ms(counts, ulysses), counts.rank_ms(ulysses))  # exchange hidden: the tiles
    assert across.received_bytes(counts).tolist() == (
        2 * KV_ROW_BYTES * counts.read.sum(axis=1) + GRAD_ROW_BYTES * counts.read.sum(axis=0)).tolist()


@pytest.fixture(scope="module")
def bench_mixes():
    """The bench's document mixes at 128K tokens, one row each."""
    rows = {}
    for mix in packing.LENGTHS:
        documents = Documents.from_position_ids(packing.batches(mix, 131072, 1, 1)[0])
        rows[mix] = (np.clip(documents.end, 0, 131072), documents.keys_seen())
    return rows


@pytest.mark.parametrize("ring,ulysses,faster_on", [(8, 1, {"longtail"}), (4, 2, set())])
def test_link_priced_choice_on_the_bench_mixes(bench_mixes, ring, ulysses, faster_on):
    """Within a node the link-priced choice is never slower (tiles and exchange) than the choice by tiles
    alone; across nodes (4 ranks a node, and 1) never slower than it or 2R chunks, and faster than the choice
    by tiles alone where that one cuts long documents over every node (the long tail on 8 ring ranks; on 4,
    the tiles alone keep its documents whole already)."""
    faster = set()
    for mix, (end, work) in bench_mixes.items():
        by_tiles, _ = packed_layout.choose(end, work, ring, ulysses)
        for per_node in (None, 4, 1):
            link = LinkCost.of_ranks(np.arange(ring * ulysses)[::ulysses], Links(ranks_per_node=per_node))
            chosen, priced = packed_layout.choose(end, work, ring, ulysses, link)
            step = float(link.rank_ms(chosen.counts, ulysses).max())
            assert step == chosen.slowest_ms
            assert step <= float(link.rank_ms(by_tiles.counts, ulysses).max()), (mix, per_node)
            assert step <= float(link.rank_ms(priced["chunks"].counts, ulysses).max()), (mix, per_node)
            assert chosen.counts.tokens.max() <= packed_layout.token_cap(131072, ring)
            if step < 0.95 * float(link.rank_ms(by_tiles.counts, ulysses).max()):
                faster.add((mix, per_node))
    assert {mix for mix, _ in faster} == faster_on and all(per_node is not None for _, per_node in faster), faster


def test_links_from_the_plan_and_the_launch(monkeypatch):
    plan = pcp.PrepareContextParallel("hybrid", 2, links=pcp.Links(ranks_per_node=4, inter_gbps=50.0))
    layout = plan_layout(plan, range(8))
    assert (layout.backend, layout.world, layout.ulysses, layout.ring) == ("hybrid", 8, 2, 4)
    link = layout.links
    assert link.nodes.tolist() == [0, 0, 1, 1]  # ring members hold ranks 0-1, 2-3, 4-5, 6-7
    assert link.ms_per_byte[0, 2] == pytest.approx(1 / 50e6) and link.ms_per_byte[0, 1] == pytest.approx(1 / 300e6)
    monkeypatch.setenv("PADDLE_LOCAL_SIZE", "2")
    assert plan_layout(pcp.PrepareContextParallel("p2p"), [4, 5, 6, 7]).links.nodes.tolist() == [2, 2, 3, 3]
    monkeypatch.delenv("PADDLE_LOCAL_SIZE")
    assert plan_layout(pcp.PrepareContextParallel("p2p"), range(4)).links.nodes_spanned == 1
    with pytest.raises(TypeError, match="paddle_cp.Links"):
        pcp.PrepareContextParallel("p2p", links=(300, 25))
    with pytest.raises(TypeError, match="paddle_cp.Links"):
        pcp.PrepareContextParallel("p2p", links={"nodes": 2})
    from paddle_cp.api.config import load_config
    _, config = load_config({"mesh": {"shape": [4], "dim_names": ["sep"]}, "cp_config": {"parallelize_plan": {
        "model": {"PrepareContextParallel": {"backend": "p2p", "links": {"ranks_per_node": 2, "inter_gbps": 50}}}}}},
        world_size=4)
    assert config["cp_config"]["parallelize_plan"]["model"].links == pcp.Links(ranks_per_node=2, inter_gbps=50)
    with pytest.raises(ValueError, match="positive int"):
        pcp.PrepareContextParallel("p2p", links=pcp.Links(ranks_per_node=0))
    with pytest.raises(ValueError, match="positive GB/s"):
        pcp.Links(inter_gbps=0).check()
