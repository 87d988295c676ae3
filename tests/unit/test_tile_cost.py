"""The GPU tile model (cost/tiles.py) against what a GPU measured: for every row of
shared/gpu/h200-flex-tiles.json (an H200 running flex_attention over layouts of packed rows), the same
positions give exactly the measured partial and full tiles of every rank, and the fit's milliseconds
within its error. The rows' positions and the chunks / whole layouts come from the measuring script
itself (shared/gpu/balance_gpu.py, loaded without PyTorch); its `documents` layout is
cost/balance.py's balanced_groups. Also against a dense mask, tile by tile, on random layouts."""
import importlib.util
import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from paddle_cp.cost import packed_layout, tiles
from paddle_cp.cost.balance import balanced_groups

ROOT = Path(__file__).resolve().parents[2]
# shared/ lies beside the clone (CI), or beside the folder of worktrees (a developer's worktree)
SHARED = next((p / "shared" / "gpu" for p in (ROOT.parent, ROOT.parent.parent) if (p / "shared" / "gpu").is_dir()),
              None)


@pytest.fixture(scope="module")
def measuring_script():
    if SHARED is None:
        pytest.skip(f"no shared/gpu beside {ROOT} or its parent: the H200 measurement is not in this checkout")
    stubs = {name: mock.MagicMock() for name in
             ("torch", "torch.nn", "torch.nn.attention", "torch.nn.attention.flex_attention")}
    with mock.patch.dict(sys.modules, stubs):  # the script's GPU half is never called here
        spec = importlib.util.spec_from_file_location("balance_gpu", SHARED / "balance_gpu.py")
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    return script


def layout_groups(script, row, pos, doc):
    """The ring group of every position in the layout a measured row names."""
    if row["layout"] == "documents":
        return balanced_groups((pos + 1)[None], row["R"])
    if row["layout"] == "mine":  # what paddle_cp chooses
        return packed_layout.ring_groups(pos, doc, row["R"])
    return script.groups_of(row["layout"], pos, doc, row["R"])


def test_tiles_equal_the_h200_measurement_and_time_within_the_fit(measuring_script):
    rows = json.loads((SHARED / "h200-flex-tiles.json").read_text())
    errors = []
    assert len(rows) == 30
    for row in rows:
        pos, doc = measuring_script.packed_row(row["dist"], row["S"])
        groups = layout_groups(measuring_script, row, pos, doc)
        counts = tiles.tile_counts(groups, tiles.document_ends(pos, doc), row["R"])
        case = (row["dist"], row["S"], row["R"], row["layout"])
        assert counts.tokens.tolist() == row["tokens"], case
        assert counts.partial.tolist() == row["rank_partial"], case
        assert counts.full.tolist() == row["rank_full"], case
        errors += (np.abs(counts.rank_ms() / np.array(row["rank_ms"]) - 1)).tolist()
    assert len(errors) == 252
    assert np.median(errors) < 0.03 and max(errors) < 0.12  # the fit: median 1.6%, worst 11%


def test_tiles_equal_the_h100_measurement_of_the_chosen_layout(measuring_script):
    """docs/measurements/h100_balance_gpu.json: an H100 ran 2N chunks, the whole-document reference and
    paddle_cp's chosen layout (`mine`) on the same rows. The tiles it counted are the ones the model counts for
    the layout packed_layout chooses today, and the H200 fit prices the H100's ranks about as well."""
    rows = [r for r in json.loads((ROOT / "docs" / "measurements" / "h100_balance_gpu.json").read_text())
            if "layout" in r]
    assert len(rows) == 30 and {r["layout"] for r in rows} == {"chunks", "whole", "mine"}
    ratios = []
    for row in rows:
        pos, doc = measuring_script.packed_row(row["dist"], row["S"])
        counts = tiles.tile_counts(layout_groups(measuring_script, row, pos, doc),
                                       tiles.document_ends(pos, doc), row["R"])
        case = (row["dist"], row["S"], row["R"], row["layout"])
        assert counts.tokens.tolist() == row["tokens"], case
        assert counts.partial.tolist() == row["rank_partial"], case
        assert counts.full.tolist() == row["rank_full"], case
        ratios += (np.array(row["rank_ms"]) / counts.rank_ms()).tolist()
    assert 1.0 < np.median(ratios) < 1.06 and min(ratios) > 0.9  # measured: median 1.03, 0.95-1.32


def dense_tiles(groups, end, ring):
    """Partial and full tiles per group from the dense mask, query tile by key tile (the definition)."""
    partial, full = np.zeros(ring, int), np.zeros(ring, int)
    for row_end in np.atleast_2d(end):
        for r in range(ring):
            q = np.flatnonzero(groups == r)
            for g in range(ring):
                k = np.flatnonzero(groups == g)
                mask = (k[None, :] <= q[:, None]) & (q[:, None] < row_end[k][None, :])
                padded = np.zeros((-(-len(q) // 128) * 128, -(-len(k) // 128) * 128), bool)
                padded[:len(q), :len(k)] = mask
                blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
                seen, every = blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))
                partial[r] += (seen & ~every).sum()
                full[r] += every.sum()
    return partial, full


@pytest.mark.parametrize("seed", range(6))
def test_tiles_equal_the_dense_mask_on_random_layouts(seed):
    rng = np.random.default_rng(seed)
    ring, seq_len, rows = int(rng.integers(2, 5)), int(rng.integers(300, 1500)), int(rng.integers(1, 3))
    end = []
    for _ in range(rows):  # documents of random lengths, one of them long
        cuts = np.unique(np.concatenate([rng.integers(1, seq_len, int(rng.integers(0, 12))), [seq_len]]))
        end.append(np.repeat(cuts, np.diff(np.concatenate([[0], cuts]))))
    runs = rng.integers(1, 300, seq_len)  # groups in runs of random lengths
    groups = np.repeat(rng.integers(0, ring, seq_len), runs)[:seq_len]
    groups[:ring] = np.arange(ring)
    counts = tiles.tile_counts(groups, np.array(end), ring)
    partial, full = dense_tiles(groups, np.array(end), ring)
    assert counts.partial.tolist() == partial.tolist() and counts.full.tolist() == full.tolist()
    assert counts.visited.sum() == (partial + full).sum()


@pytest.mark.parametrize("seed", range(6))
def test_counts_by_runs_equal_the_counts_by_positions(seed):
    """run_tile_counts (a layout search's pricing) against tile_counts on random one-row layouts: every count
    equal, pieces of documents anywhere, runs split finer than a document's piece on a group too, padding (keys
    no query sees) at the end of half of them."""
    rng = np.random.default_rng(seed)
    ring, seq_len = int(rng.integers(2, 9)), int(rng.integers(300, 6000))
    cuts = np.unique(np.concatenate([rng.integers(1, seq_len, int(rng.integers(0, 30))), [seq_len]]))
    end = np.repeat(cuts, np.diff(np.concatenate([[0], cuts])))
    padding = int(rng.integers(1, 300)) if seed % 2 else 0
    end[seq_len - padding:] = np.arange(seq_len - padding, seq_len)  # a padding key's document ends before it
    groups = np.repeat(rng.integers(0, ring, seq_len), rng.integers(1, 400, seq_len))[:seq_len]
    bounds = np.unique(np.concatenate([[0], cuts[:-1], np.flatnonzero(np.diff(groups)) + 1,
                                       np.arange(seq_len - padding, seq_len),
                                       rng.integers(1, seq_len, 5)]))  # runs: one document, one group
    by_positions = tiles.tile_counts(groups, end, ring)
    by_runs = tiles.run_tile_counts(bounds, np.diff(np.append(bounds, seq_len)), groups[bounds], end[bounds], ring)
    for name in ("partial_from", "full_from", "read", "tokens"):
        assert getattr(by_runs, name).tolist() == getattr(by_positions, name).tolist(), name


@pytest.mark.parametrize("seed", range(4))
def test_counts_of_a_change_recount_its_groups_only(seed):
    """run_tile_counts with the counts before a change (positions of one group given to another): the same counts
    as tile_counts of the changed layout, from the documents the two groups hold alone."""
    rng = np.random.default_rng(seed)
    for _ in range(25):
        ring, seq_len = int(rng.integers(2, 9)), int(rng.integers(300, 5000))
        cuts = np.unique(np.concatenate([rng.integers(1, seq_len, int(rng.integers(0, 30))), [seq_len]]))
        end = np.repeat(cuts, np.diff(np.concatenate([[0], cuts])))
        before = np.repeat(rng.integers(0, ring, seq_len), rng.integers(1, 400, seq_len))[:seq_len]
        given, taking = (int(g) for g in rng.choice(ring, 2, replace=False))
        held = np.flatnonzero(before == given)
        after = before.copy()
        after[held[rng.integers(0, len(held) + 1):][:int(rng.integers(0, 600))]] = taking
        previous = tiles.run_tile_counts(*tiles.row_runs(before, end), ring)
        changed = tiles.run_tile_counts(*tiles.row_runs(after, end), ring, previous, (given, taking))
        by_positions = tiles.tile_counts(after, end, ring)
        for name in ("partial_from", "full_from", "read", "tokens"):
            assert getattr(changed, name).tolist() == getattr(by_positions, name).tolist(), name
