"""Which keys each query sees, from the definitions alone (the reference paddle_cp's planning is tested against)."""
import numpy as np


def visible(seq, causal, doc_ids=None, window=None, valid=None):
    """bool [b or 1, seq, seq]: query i sees key j (causal: j <= i; documents: same id; window w: j > i - w;
    `valid` [b, seq]: False for padding keys)."""
    i, j = np.arange(seq)[:, None], np.arange(seq)[None]
    seen = (j <= i if causal else np.ones((seq, seq), bool))[None]
    if doc_ids is not None:
        seen = seen & (doc_ids[:, :, None] == doc_ids[:, None, :])
    if window is not None:
        seen = seen & (j > i - window)
    if valid is not None:
        seen = seen & valid[:, None, :]
    return seen
