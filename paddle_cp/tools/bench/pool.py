"""The dp x sep pool against fixed dp x sep, priced by the GPU tile model and the exchange plan (`pcp-bench --pool`).

    pcp-bench --pool --dp 2 --sep 4 --seq 16384 --batch 2 --documents stdlib lognormal longtail uniform

For each document mix (tools/packing.py) a global batch of dp x `--batch` rows of `--seq` tokens (`--doc-batch`
picks which of the stream's batches) is laid out three ways over R = dp x sep ranks:
- `fixed`: replica d takes rows d x batch .. (d + 1) x batch - 1 and lays them out over its sep group with the
  documents layout (PrepareContextParallel without `pool`);
- `pool`: the rows joined into one sequence laid out over all R ranks (PrepareContextParallel(pool=True),
  attention/layout/pool.py) for links within one node;
- `pool-nodes`: the same laid out for nodes of `--ranks-per-node` ranks (its exchange across them priced at the
  network's rate: a cut document's pieces kept on one node).
Per layout, over all R ranks (model figures, no GPU runs; forward + backward of one causal attention layer):
`tiles max/mean`, the slowest rank's tile ms (partial and full 128 x 128 tiles at tile_cost's H200 rates, the
fixed cost per rank left out) over the mean; `slowest ms` the slowest rank's predicted step within a node
(tiles, the planned exchange at NVLink's rate, the fixed cost) and across nodes of `--ranks-per-node` ranks;
MiB a rank sends per forward + backward (mean over ranks, the tile model's shape: 8 k/v heads of 128, k/v and
their gradients in one dtype): the planned exchange's (only the k/v rows other ranks' tiles read, forward,
again in backward, their gradients home) and `read`, 3 x the rows read; `planned/read` their totals' ratio
(1.00 when both are 0).
"""
from __future__ import annotations

import argparse

import numpy as np

from paddle_cp.tools.units import tokens

LAYOUTS = ("fixed", "pool", "pool-nodes")


def _priced(layout, seq_len, documents, links, kv_row_bytes):
    """Per rank of one ring `layout` over a batch with `documents`: tile ms, predicted step ms within a node and
    on `links`, bytes planned and read (ExchangeBytes), tokens held (over the batch's rows)."""
    from paddle_cp.attention.layout.exchange_plan import ExchangePlan, exchange_bytes
    from paddle_cp.cost.links import LinkCost
    from paddle_cp.cost.tiles import tile_counts

    positions = layout.ring_positions(seq_len)
    groups = np.empty(seq_len, np.int64)
    for g, p in enumerate(positions):
        groups[p] = g
    counts = tile_counts(groups, np.clip(documents.end, 0, seq_len), layout.ring)
    sent = exchange_bytes(ExchangePlan(positions, True, documents), kv_row_bytes, kv_row_bytes)
    within = LinkCost(np.zeros(layout.ring, np.int64))
    return {"tile_ms": counts.step_ms().sum(axis=1), "within_ms": within.rank_ms(counts),
            "across_ms": links.rank_ms(counts), "planned": sent.planned, "read": sent.read,
            "tokens": counts.tokens * documents.end.shape[0], "candidate": layout.split.name}


def compare(position_ids, dp, sep, ranks_per_node=None, kv_row_bytes=None):
    """{layout: figures over all R = dp x sep ranks} of a global batch of packed `position_ids` ([dp x b, S]):
    `fixed` (each replica's b rows over its sep group), `pool` and `pool-nodes` (the rows joined, over all R
    ranks, laid out for one node and for nodes of `ranks_per_node` ranks, default sep)."""
    from paddle_cp.attention.layout.pool import joined_documents, pool_layout
    from paddle_cp.attention.layout.sequence_layout import SequenceLayout
    from paddle_cp.attention.masks.block_mask import Documents
    from paddle_cp.cost.links import KV_ROW_BYTES, LinkCost, Links

    kv_row_bytes = kv_row_bytes or KV_ROW_BYTES
    position_ids = np.asarray(position_ids)
    rows, seq_len = position_ids.shape
    if rows % dp:
        raise ValueError(f"{rows} rows do not split over dp={dp} replicas")
    links = Links(ranks_per_node=ranks_per_node or sep)
    per_replica = rows // dp
    fixed = []
    for replica in range(dp):
        documents = Documents.from_position_ids(position_ids[replica * per_replica:(replica + 1) * per_replica])
        link = LinkCost.of_ranks(np.arange(sep) + replica * sep, links)
        layout = SequenceLayout("p2p", sep, links=link).for_batch(documents)
        fixed.append(_priced(layout, seq_len, documents, link, kv_row_bytes))
    link = LinkCost.of_ranks(np.arange(dp * sep), links)
    documents = Documents.from_position_ids(position_ids)
    joined = joined_documents(documents, rows, seq_len)
    pools = {}
    for name, laid_for in (("pool", LinkCost(np.zeros(dp * sep, np.int64))), ("pool-nodes", link)):
        layout = pool_layout(SequenceLayout("p2p", dp * sep, links=laid_for), documents, rows, seq_len, replicas=dp)
        pools[name] = _summary(_priced(layout, rows * seq_len, joined, link, kv_row_bytes))
    replicas = {key: np.concatenate([f[key] for f in fixed]) for key in fixed[0] if key != "candidate"}
    replicas["candidate"] = "/".join(f["candidate"] for f in fixed)
    return {"fixed": _summary(replicas), **pools}


def _summary(figures):
    tiles = figures["tile_ms"]
    planned, read = float(figures["planned"].sum()), float(figures["read"].sum())
    return {"candidate": figures["candidate"], "tiles_max_over_mean": float(tiles.max() / tiles.mean()),
            "slowest_tiles_ms": float(tiles.max()), "slowest_within_ms": float(figures["within_ms"].max()),
            "slowest_across_ms": float(figures["across_ms"].max()),
            "planned_mib": float(figures["planned"].mean()) / 2 ** 20, "read_mib": float(figures["read"].mean()) / 2 ** 20,
            "planned_over_read": planned / read if read else 1.0 if not planned else float("inf"),
            "tokens_max": int(figures["tokens"].max()), "tokens_min": int(figures["tokens"].min())}


def rows_of(args):
    from paddle_cp.tools import packing

    out = []
    for mix in args.documents:
        batch = packing.batches(mix, args.seq, args.dp * args.batch, args.doc_batch + 1)[args.doc_batch]
        for layout, figures in compare(batch, args.dp, args.sep, args.ranks_per_node).items():
            out.append({"documents": mix, "dp": args.dp, "sep": args.sep, "seq": args.seq, "batch": args.batch,
                        "layout": layout, **figures})
    return out


def table(rows, ranks_per_node):
    from paddle_cp.tools.text import ruled_table

    head = (f"{'documents':10} {'dp x sep':>8} {'seq':>7} {'layout':10} {'tiles max/mean':>14} {'slowest ms':>10} "
            f"{'across ms':>9} {'planned MiB':>11} {'read MiB':>8} {'planned/read':>12} {'tok max':>7} {'tok min':>7}")
    return ruled_table(head, [
        f"{r['documents']:10} {str(r['dp']) + ' x ' + str(r['sep']):>8} {r['seq']:>7} {r['layout']:10} "
        f"{r['tiles_max_over_mean']:>14.3f} {r['slowest_within_ms']:>10.2f} {r['slowest_across_ms']:>9.2f} "
        f"{r['planned_mib']:>11.1f} {r['read_mib']:>8.1f} {r['planned_over_read']:>12.3f} {r['tokens_max']:>7} "
        f"{r['tokens_min']:>7}" for r in rows]) + (
        "\n(model figures, no GPU ran: over all dp x sep ranks, forward + backward of one causal attention layer; "
        "fixed: each replica's rows over its sep group, pool: the global batch's rows joined, over every rank, "
        "laid out for one node, pool-nodes: for the nodes below; "
        "tiles max/mean: the slowest rank's tile ms over the mean; slowest ms: tiles, planned exchange and fixed "
        f"cost within a node; across ms: the same with {ranks_per_node or 'sep'} ranks a node; MiB a rank sends "
        "(mean): planned exchange, and 3 x the k/v rows other ranks' tiles read)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    parser.add_argument("--sep", type=int, default=4, help="context-parallel ranks a replica")
    parser.add_argument("--seq", type=tokens, default=16384, help="tokens a row (16K = 16384)")
    parser.add_argument("--batch", type=int, default=2, help="rows a replica (the global batch: dp x this)")
    parser.add_argument("--documents", nargs="+", default=["stdlib", "lognormal", "longtail", "uniform"],
                        help="document length mixes (tools/packing.py) or files of lengths")
    parser.add_argument("--doc-batch", type=int, default=0, help="which batch of the packed stream (default: first)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks a node for the step across nodes (default: --sep, a replica a node)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.dp < 1 or args.sep < 1 or args.batch < 1:
        parser.error("--dp, --sep and --batch must be positive")
    if args.seq < args.sep:
        parser.error(f"--seq {args.seq} is shorter than --sep {args.sep}: every rank needs a token")
    return args


def main(argv=None):
    from paddle_cp.tools.text import show

    args = parse_args(argv)
    rows = rows_of(args)
    show(table(rows, args.ranks_per_node), {"rows": rows}, args.json)
    return rows


if __name__ == "__main__":
    main()
