"""Packed-document batches from a length distribution, and each rank's attention work under a layout.

Distributions (`LENGTHS`): `stdlib`, the main job's documents (examples/stdlib_text.py: one per
top-level standard-library module, sorted by name, BOS + its first `cap` - 2 bytes + EOS, cap
1536); `lognormal`, long-tailed lengths with median 600 (sigma 1, seed 0); `longtail`, median 2000
and sigma 1.5 (a few documents past 64K); `uniform`, 1 to 4000 tokens; `single`, one document
longer than any row; or a file with one length per line. Documents follow each other in one stream cut into rows of `seq_len` tokens (a
document cut by a row's end continues as a new document in the next row, as the main job packs).

The work of a rank is what the documents layout balances: the keys each of its queries sees
(causal, inside its document), summed over the rows; a ring group's work is shared by its
Ulysses ranks (they split the heads).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

STDLIB_CAP = 1536  # the main job's --max-document
LOGNORMAL_MEDIAN, LOGNORMAL_SIGMA = 600, 1.0


def stdlib_lengths(cap=STDLIB_CAP):
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise ValueError(f"no *.py files in {sysconfig.get_paths()['stdlib']}: the 'stdlib' lengths read them")
    return np.array([min(f.stat().st_size, cap - 2) + 2 for f in files], dtype=np.int64)


def lognormal_lengths(count=20000, median=LOGNORMAL_MEDIAN, sigma=LOGNORMAL_SIGMA, seed=0):
    lengths = np.random.default_rng(seed).lognormal(np.log(median), sigma, count)
    return np.maximum(1, np.round(lengths)).astype(np.int64)


LENGTHS = {"stdlib": stdlib_lengths, "lognormal": lognormal_lengths,
           "longtail": lambda: lognormal_lengths(median=2000, sigma=1.5),
           "uniform": lambda: np.random.default_rng(0).integers(1, 4001, 20000),
           "single": lambda: np.array([2 ** 40])}


def document_lengths(source):
    """Lengths of a named distribution (`LENGTHS`) or of a file with one positive integer per line."""
    if source in LENGTHS:
        return LENGTHS[source]()
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"document lengths {source!r}: name one of {sorted(LENGTHS)} or a file of lengths")
    lengths = np.array([int(word) for word in path.read_text().split()], dtype=np.int64)
    if not len(lengths) or (lengths < 1).any():
        raise ValueError(f"{source}: give one positive integer length per line")
    return lengths


def packed_position_ids(lengths, seq_len, rows):
    """int64 [rows, seq_len]: position ids restarting at 0 at each document (the lengths repeated as needed)."""
    repeat = -(-rows * seq_len // int(lengths.sum()))
    lengths = np.tile(lengths, repeat + 1)
    starts = np.cumsum(lengths) - lengths  # of each document in the stream
    new = np.zeros(rows * seq_len, bool)
    new[starts[starts < rows * seq_len]] = True
    new[::seq_len] = True  # a row starts a document
    index = np.arange(rows * seq_len)
    return (index - np.maximum.accumulate(np.where(new, index, 0))).reshape(rows, seq_len)


def batches(source, seq_len, batch, steps):
    """`steps` batches of [batch, seq_len] packed position ids, consecutive in the stream."""
    positions = packed_position_ids(document_lengths(source), seq_len, batch * steps)
    return [positions[step * batch:(step + 1) * batch] for step in range(steps)]


def rank_work(layout, position_ids):
    """Per rank of `layout` (a batch's SequenceLayout): the keys its queries see, summed over rows."""
    per_position = (np.asarray(position_ids) + 1).sum(axis=0)  # causal, inside each document
    seq_len = per_position.shape[0]
    return [float(per_position[layout.group_positions(seq_len, index // layout.ulysses)].sum()) / layout.ulysses
            for index in range(layout.world)]
