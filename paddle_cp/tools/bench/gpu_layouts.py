"""A packed batch's layouts priced for a GPU by the tile model (cost/tiles.py): the one
paddle_cp chooses (cost/packed_layout.py) beside 2R chunks and the whole-document layout.
Model figures, no GPU runs: predicted ms of the slowest rank (forward + backward of one attention
layer on an H200, tile_cost's fit), its tiles, tokens per rank, kernel calls
and the host time the choice takes; and each layout's predicted step with its exchange priced on the
links (cost/links.py), within a node and across nodes.

Kernel calls: one per ring step whose key block holds a tile the rank's queries see, per direction
(forward and backward), the plan of one call per step: calls per pass = non-empty steps of R.

Bytes (`kv_row_bytes` given; computed from the layout, not measured): what a rank sends in one forward +
backward of one layer, mean over ranks, whole blocks (`whole_blocks`: every block to every member, k/v forward,
again in backward, the gradients home), the exchange plan's (attention/layout/exchange_plan.py: only the rows read), and
the bytes read, 3 x the k/v rows of a rank's block that other ranks' visible tiles read.
"""
from __future__ import annotations

import time

import numpy as np

from ...cost import packed_layout
from ...attention.layout.exchange_plan import ExchangePlan, exchange_bytes
from ...cost.links import LinkCost, Links
from ...attention.masks.block_mask import Documents
from ...cost.tiles import TILE
from ...cost.attention import degrees
from ..text import ruled_table

COMPARED = ("chosen", "chunks", "whole", "tiles", "across")


def layout_rows(position_ids, backend, world, ulysses_degree=None, kv_row_bytes=None, ranks_per_node=1):
    """One row per COMPARED layout of a batch of packed position ids ([rows, S]): `chosen`, what paddle_cp
    chooses on one node (tiles and exchange at NVLink's rate, link_cost.py), 2R `chunks`, `whole`, `tiles`
    (the choice by tiles alone), `across` (the choice with `ranks_per_node` ranks a node, at Links' default
    rates); each with its predicted step within a node and across (`step_within_ms`, `step_across_ms`).
    With `kv_row_bytes` (one token's k and v on one rank, its batch rows and heads; their gradients the same
    size) also the bytes."""
    ring, ulysses = degrees(backend, world, ulysses_degree)
    documents = Documents.from_position_ids(position_ids)
    seq_len = documents.seq_len
    within = LinkCost(np.zeros(ring, np.int64))
    across = LinkCost.of_ranks(np.arange(world)[::ulysses], Links(ranks_per_node=ranks_per_node))
    start = time.process_time()
    work = documents.keys_seen()
    chosen, priced = packed_layout.choose(documents.end, work, ring, ulysses, within)
    choose_ms = (time.process_time() - start) * 1e3
    picks = {"chosen": chosen, "tiles": packed_layout.choose(documents.end, work, ring, ulysses)[0],
             "across": packed_layout.choose(documents.end, work, ring, ulysses, across)[0]}
    chunks_ms = priced["chunks"].counts.slowest_ms(ulysses)
    rows = []
    for name in COMPARED:
        candidate = picks.get(name) or priced[name]
        counts = candidate.counts
        slowest = int(np.argmax(counts.rank_ms(ulysses)))
        tiles_ms = counts.slowest_ms(ulysses)
        rows.append({
            "layout": name, "candidate": candidate.name, "backend": backend, "seq": seq_len, "nproc": world,
            "ring": ring, "ulysses": ulysses, "slowest_ms": tiles_ms, "vs_chunks": tiles_ms / chunks_ms,
            "step_within_ms": float(within.rank_ms(counts, ulysses).max()),
            "step_across_ms": float(across.rank_ms(counts, ulysses).max()), "ranks_per_node": ranks_per_node,
            "partial_tiles": int(counts.partial[slowest]), "full_tiles": int(counts.full[slowest]),
            "tokens_max": int(-(-counts.tokens.max() // ulysses)), "tokens_mean": seq_len / world,
            "memory_bound_ok": bool(counts.tokens.max() <= packed_layout.token_cap(seq_len, ring)),
            "kernel_calls_per_pass": int(counts.kernel_steps().max()),
            "planning_ms": choose_ms if name == "chosen" else candidate.host_ms or 0.0,
        })
        if kv_row_bytes is not None:
            rows[-1].update(_bytes(candidate.groups, documents, ring, kv_row_bytes))
    return rows


def _bytes(groups, documents, ring, kv_row_bytes):
    """MiB a rank sends per forward + backward (mean over ranks): whole blocks, planned, read; and the most a rank
    sends under the plan."""
    plan = ExchangePlan([np.flatnonzero(groups == g) for g in range(ring)], True, documents)
    sent = exchange_bytes(plan, kv_row_bytes, kv_row_bytes)
    mib = {f"{name}_mib": float(values.mean()) / 2 ** 20 for name, values in sent._asdict().items()}
    return dict(mib, planned_max_mib=float(sent.planned.max()) / 2 ** 20)


# the columns naming a row's case and layout, first in the layouts' table and in their bytes' table
CASE_HEAD = f"{'documents':10} {'backend':8} {'seq':>7} {'N':>2} {'layout':7} {'candidate':10}"


def _case(r):
    return (f"{r['documents']:10} {r['backend']:8} {r['seq']:>7} {r['nproc']:>2} {r['layout']:7} "
            f"{r['candidate']:10}")


def table(rows):
    head = (f"{CASE_HEAD} {'slowest ms':>10} {'vs chunks':>9} {'partial':>7} {'full':>6} {'tok max':>7} {'tok mean':>8} {'calls':>5} {'host ms':>7}")
    return ruled_table(head, [
        f"{_case(r)} {r['slowest_ms']:>10.2f} {r['vs_chunks']:>9.3f} {r['partial_tiles']:>7} {r['full_tiles']:>6} "
        f"{r['tokens_max']:>7} {r['tokens_mean']:>8.0f} {r['kernel_calls_per_pass']:>5} {r['planning_ms']:>7.1f}"
        for r in rows]) + (f"\n(model figures, no GPU ran: slowest rank, fwd + bwd of one attention layer, H200; "
                           f"partial/full: its {TILE}x{TILE} tiles; calls: the most kernel calls of a rank per "
                           "ring pass and direction; host ms: CPU time choosing among every candidate, or building "
                           "and pricing that one layout alone)")


def steps_table(rows):
    """Predicted steps (slowest rank: tiles and the planned exchange, link_cost.py) of the choice by tiles
    alone, the link-priced choice and 2R chunks, within a node and across nodes."""
    by = {}
    for r in rows:
        by.setdefault((r["documents"], r["backend"], r["seq"], r["nproc"], r["ranks_per_node"]), {})[r["layout"]] = r
    head = (f"{'documents':10} {'backend':8} {'seq':>7} {'N':>2} {'per node':>8} | {'tiles':>7} {'linked':>7} "
            f"{'chunks':>7} | {'tiles':>7} {'linked':>7} {'chunks':>7} | choices: tiles -> linked; across")
    lines = [
        f"{d:10} {b:8} {s:>7} {n:>2} {p:>8} | {r['tiles']['step_within_ms']:>7.2f} "
        f"{r['chosen']['step_within_ms']:>7.2f} {r['chunks']['step_within_ms']:>7.2f} | "
        f"{r['tiles']['step_across_ms']:>7.2f} {r['across']['step_across_ms']:>7.2f} "
        f"{r['chunks']['step_across_ms']:>7.2f} | {r['tiles']['candidate']} -> {r['chosen']['candidate']}; "
        f"{r['across']['candidate']}"
        for (d, b, s, n, p), r in by.items()]
    return ruled_table(head, lines) + (
        "\n(model figures, no GPU ran: the slowest rank's predicted ms, forward + backward of one attention layer: "
        "H200 tiles and the planned k/v exchange at the fit's shape, step s+1's exchange beside step s's tiles; "
        f"first within one node ({Links().intra_gbps:.0f} GB/s), then across nodes of `per node` ranks "
        f"({Links().inter_gbps:.0f} GB/s between them); tiles: the layout chosen by tiles alone, "
        "linked: chosen with the links priced, chunks: 2R chunks)")


def bytes_table(rows):
    """The rows' bytes (those priced with kv_row_bytes)."""
    head = (f"{CASE_HEAD} {'whole MiB':>9} {'planned':>8} {'read':>8} {'read/whole':>10} {'planned max':>11}")
    return ruled_table(head, [
        f"{_case(r)} {r['whole_blocks_mib']:>9.1f} {r['planned_mib']:>8.1f} {r['read_mib']:>8.1f} "
        f"{r['read_mib'] / r['whole_blocks_mib'] if r['whole_blocks_mib'] else 0:>10.3f} {r['planned_max_mib']:>11.1f}"
        for r in rows if "whole_blocks_mib" in r]) + (
        "\n(computed from the layout, not measured: MiB a rank sends per forward + backward of one attention "
        "layer, mean over ranks; whole: whole blocks, every k/v block to every member and every gradient "
        "home (rotate='allgather' sends as much); planned: only the rows read (attention/layout/exchange_plan.py, "
        "rotate='planned'); read: 3 x the k/v rows of a rank's "
        "block that other ranks' visible tiles read; planned max: the rank sending most)")
