"""Which keys each query sees: causal, windows, documents, padding and dense masks as row ranges per key."""
