"""Sequence helpers: shard/unshard sequences, whole-sequence positions, loss weights, dp batches."""
