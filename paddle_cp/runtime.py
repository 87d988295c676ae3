"""Per-process state of paddle_cp, in one place, with one reset (tests use it).

- `batches`: SequenceInfo of the batches whose top layer is running (innermost last),
  published by PrepareContextParallel for the attention to read.
- `running`: ContextParallel frames of layers whose forward is running (innermost last).
- `planned`: module -> the ContextParallel plan that covers it (the planned layer and its
  sublayers), so an attention call made outside the layer's forward (recompute) is routed too.
- `attention_work`: query-key pairs computed and skipped by attention forwards.
"""
from __future__ import annotations

import weakref

batches = []
running = []
planned = weakref.WeakKeyDictionary()
attention_work = {"computed": 0, "skipped": 0}


def reset():
    """Forget every batch, running layer, planned module and counter of this process."""
    batches.clear()
    running.clear()
    planned.clear()
    attention_work.update(computed=0, skipped=0)
