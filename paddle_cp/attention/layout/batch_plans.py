"""Plans that depend on a batch's facts alone, made once and read by every layer of the batch.

Attention's masks (ring.RingMasks: each ring step's row bounds, trimmed extents, blockwise tiles and
their device copies) depend only on the layout, the length, the documents, the padding, causality and
the window, not on a layer's tensors: the first layer of a batch makes them, the others (and recompute's
replay in backward) find them here. A SequenceLayout owns one (`layout.plans`); facts are matched by
identity for arrays and objects (a batch's Documents and padding are built once per batch) and by
value for numbers; the few most recent batches are kept (a pipeline interleaves micro-batches).
"""
from __future__ import annotations

KEPT = 8  # batches (times windows used) kept


def _same(a, b):
    return a is b or (isinstance(a, (bool, int, float, str)) and type(a) is type(b) and a == b)


class BatchPlans:
    def __init__(self, kept=KEPT):
        self.kept = kept
        self._entries = []  # [(facts, plan)], most recent last

    def get(self, facts, make):
        """The plan made for `facts` (a tuple), made by `make()` if none is kept."""
        for i, (known, plan) in enumerate(self._entries):
            if len(known) == len(facts) and all(_same(a, b) for a, b in zip(known, facts)):
                self._entries.append(self._entries.pop(i))
                return plan
        plan = make()
        self._entries = [*self._entries[-(self.kept - 1):], (facts, plan)]
        return plan

    def __len__(self):
        return len(self._entries)
