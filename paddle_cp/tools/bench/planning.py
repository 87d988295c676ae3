"""Host time to plan one layer's attention, and the op calls the plan makes (`pcp-bench --planning`).

    pcp-bench --planning --nproc 8 --seq 131072 --documents lognormal --doc-batch 1

For a row of packed documents (tools/packing.py: `--documents stdlib|lognormal|FILE`, `--doc-batch`
picks the row) and each layout (`documents`: what PrepareContextParallel gives the batch by default;
`chunks`: 2R chunks), every p2p rank's plan of one layer's causal ring attention is made as the
attention makes it (api.ring_masks, then per ring step the BlockMask, its trimmed extent and, for a
flashmask step, its row indices copied to the device; the blockwise kernel's tiles for the CPU path).
One process plans for every rank in turn; no kernel runs. Reported per layout, slowest rank:

Times are host CPU time of this process (the least of 3 runs), so other load on the machine does not count:
- `first_layer_ms`: the GPU path's planning for the first layer of a batch (nothing made yet);
- `later_layer_ms`: the same for every later layer (the batch's masks found in the layout's cache);
- `cpu_first_layer_ms`: the blockwise kernel's tile plans on top (the CPU path, first layer);
- `op_calls_per_step`: forward op calls of each ring step (flash_attn or flashmask_attention: 0 or 1;
  backward the same), `op_calls`: their sum, `blockwise_tiles`: tiles the CPU kernel visits.
"""
from __future__ import annotations

import argparse
import json
import time

from paddle_cp.tools.units import tokens

TILE = 512  # the blockwise kernel's default tile


def plan_layer(layout, seq_len, documents, ring_index, batch=1, tiles=False):
    """One layer's attention plan for ring group `ring_index`, as the attention makes it: the forward op calls
    of each ring step (0 or 1) and, with `tiles`, the blockwise kernel's visited tiles."""
    from paddle_cp.attention.dispatch.api import ring_masks
    from paddle_cp.attention.masks.mask import Mask

    masks = ring_masks(layout, seq_len, ring_index, Mask(True, documents=documents))
    calls, visited = [], 0
    for step in range(layout.ring):
        mask = masks.block((ring_index - step) % layout.ring)
        extent = mask.extent()
        if extent.kind == "some":
            mask.row_indices(batch)
        calls.append(int(extent.kind != "none"))
        if tiles:
            visited += sum(len(seen) for _, seen in mask.tile_plan(TILE)[0])
    return calls, visited


def _timed(call, fresh=None, repeats=3):
    """(ms, result) of `call()`: the least of `repeats` runs in this process's CPU time (what planning costs
    the host, whatever else the machine runs), `fresh()` before each."""
    best = None
    for _ in range(repeats):
        if fresh:
            fresh()
        start = time.process_time()
        result = call()
        spent = (time.process_time() - start) * 1e3
        best = spent if best is None else min(best, spent)
    return best, result


def measure(seq_len, ring, position_ids, split):
    """The figures of one layout (see the module's doc) for the row `position_ids` ([1, seq_len])."""
    from paddle_cp.attention.layout.batch_plans import BatchPlans
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout
    from paddle_cp.attention.masks.block_mask import Documents

    documents = Documents.from_position_ids(position_ids)
    layout = SequenceLayout("p2p", ring).for_batch(documents, split)

    def new_batch():  # nothing planned yet
        layout.plans = BatchPlans()

    figures = {"first_layer_ms": [], "later_layer_ms": [], "cpu_first_layer_ms": []}
    calls, tiles = [], []
    for index in range(ring):
        first, (steps, _) = _timed(lambda: plan_layer(layout, seq_len, documents, index), new_batch)
        later, _ = _timed(lambda: plan_layer(layout, seq_len, documents, index))
        cpu, (_, visited) = _timed(lambda: plan_layer(layout, seq_len, documents, index, tiles=True), new_batch)
        for key, value in zip(figures, (first, later, cpu)):
            figures[key].append(value)
        calls.append(steps)
        tiles.append(visited)
    return {"layout": layout.split.name, **{key: max(values) for key, values in figures.items()},
            "op_calls_per_step": max(calls, key=sum), "op_calls": max(sum(c) for c in calls),
            "blockwise_tiles": max(tiles)}


def run(seq_len, ring, source, row=0, splits=("documents", "chunks")):
    from paddle_cp.tools import packing

    position_ids = packing.packed_position_ids(packing.document_lengths(source), seq_len, row + 1)[row:]
    documents = int((position_ids == 0).sum())
    return [{"seq": seq_len, "ring": ring, "documents": documents, "source": source, **measure(seq_len, ring,
                                                                                                 position_ids, split)}
            for split in splits]


def table(results):
    head = ["layout", "docs", "first_layer_ms", "later_layer_ms", "cpu_first_layer_ms", "op_calls", "blockwise_tiles"]
    lines = [" | ".join(head)]
    for r in results:
        lines.append(" | ".join([r["layout"], str(r["documents"]), *(f"{r[k]:.1f}" for k in head[2:5]),
                                 str(r["op_calls"]), str(r["blockwise_tiles"])]))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=8, help="ring ranks (p2p) to plan for")
    parser.add_argument("--seq", type=tokens, nargs="+", default=[131072], help="sequence lengths (128K = 131072)")
    parser.add_argument("--documents", default="lognormal", metavar="LENGTHS",
                        help="stdlib, lognormal or a file of lengths (tools/packing.py)")
    parser.add_argument("--doc-batch", type=int, default=1, help="which row of the packed stream")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = [r for seq in args.seq for r in run(seq, args.nproc, args.documents, args.doc_batch)]
    print(table(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return results
