"""Activation memory at long sequence lengths: token-wise blocks run in sequence tiles (sequence_tiles.py),
recomputed layers' saved inputs kept in host memory (host_offload.py)."""
