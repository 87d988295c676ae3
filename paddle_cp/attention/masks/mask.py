"""The mask of one attention call, as one value: which keys each query sees over the global sequence.

What the call says (causality, a sliding window, a dense mask of this rank's query rows) and what its
batch says (documents, padding keys) travel together from the entry point to the ring's BlockMasks. The
facts without the dense mask depend on the batch alone: the masks they make are kept per batch
(layout/batch_plans.py); a dense mask is a layer's tensor, applied per call on top of them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .block_mask import Documents


@dataclass(frozen=True)
class Mask:
    """`window`: causal sliding window (query i sees keys i-w < j <= i); `documents`: attention stays inside
    each document; `valid`: [b or 1, seq_len] bool (numpy), False for padding keys no query sees; `dense`:
    this rank's query rows of a dense mask, [b or 1, 1 or heads, s_local, seq_len] (bool, or additive)."""

    causal: bool = False
    window: int | None = None
    documents: Documents | None = None
    valid: np.ndarray | None = None
    dense: object = None

    def batch_facts(self):
        """What the per-batch masks are made from (matched by identity for the arrays: built once per batch)."""
        return self.causal, self.window, self.documents, self.valid

    def without_dense(self):
        return self if self.dense is None else replace(self, dense=None)

    def with_dense(self, dense):
        return replace(self, dense=dense)

    def of_batch(self, documents, valid):
        """This call's mask over a batch with `documents` and padding `valid` (None: none)."""
        return replace(self, documents=documents, valid=valid)
