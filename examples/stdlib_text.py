"""Real text on every machine, nothing to download: the source files of Python's standard library as
byte-level documents, packed into long sequences.

One document per file (the top-level `*.py` modules, sorted by name: a fixed list for a given Python):
BOS, the file's first `max_document - 2` bytes, EOS. A token is a byte (0-255) or BOS/EOS. The documents
follow each other in one stream cut into sequences of `seq_len` tokens; a document cut by a sequence edge
continues as a new document in the next sequence. Within a sequence, position ids restart at 0 where a
document starts (they mark the documents for attention and drive RoPE), and a token's label is the next
token of its own document (IGNORE at a document's last token).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import NamedTuple

import numpy as np

BOS, EOS = 256, 257
VOCAB_SIZE = 258
IGNORE = -100  # PaddleFormers' ignore_index


class PackedBatch(NamedTuple):
    input_ids: np.ndarray      # [b, s] int64
    labels: np.ndarray         # [b, s] int64, IGNORE where the next token belongs to another document
    position_ids: np.ndarray   # [b, s] int64, 0 at each document's first token
    document_ends: np.ndarray  # [b, s] int32: the (exclusive) end row of each token's document


def stdlib_files():
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def token_stream(max_document, min_tokens):
    """(tokens, document number) of at least `min_tokens` tokens: the documents one after the other,
    starting again at the first file when they are used up."""
    files = stdlib_files()
    if not files:
        raise ValueError(f"no *.py files in {sysconfig.get_paths()['stdlib']}: this example reads them as text")
    tokens, documents, count = [], [], 0
    while count < min_tokens:
        data = np.frombuffer(files[len(tokens) % len(files)].read_bytes()[: max_document - 2], dtype=np.uint8)
        tokens.append(np.concatenate([[BOS], data, [EOS]]).astype(np.int64))
        documents.append(np.full(len(data) + 2, len(documents), np.int64))
        count += len(data) + 2
    return np.concatenate(tokens), np.concatenate(documents)


def packed_batches(steps, batch_size, seq_len, max_document):
    """`steps` PackedBatch of `batch_size` sequences each, the same on every machine with this Python."""
    tokens, documents = token_stream(max_document, steps * batch_size * seq_len + 1)
    for step in range(steps):
        rows = [_sequence(tokens, documents, (step * batch_size + row) * seq_len, seq_len) for row in range(batch_size)]
        yield PackedBatch(*(np.stack(parts) for parts in zip(*rows)))


def _sequence(tokens, documents, start, seq_len):
    ids, doc = tokens[start:start + seq_len], documents[start:start + seq_len]
    same_document_next = documents[start + 1:start + seq_len + 1] == doc
    labels = np.where(same_document_next, tokens[start + 1:start + seq_len + 1], IGNORE)
    starts = np.flatnonzero(np.diff(doc, prepend=-1))  # first row of each document in this sequence
    ends = np.append(starts[1:], seq_len)
    which = np.searchsorted(starts, np.arange(seq_len), side="right") - 1  # [s]: the document of each row
    positions = np.arange(seq_len) - starts[which]
    return ids, labels, positions, ends[which].astype(np.int32)
