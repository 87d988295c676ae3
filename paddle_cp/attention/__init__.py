"""Attention across context-parallel ranks: kernels, merging, layouts, ring, Ulysses."""
from .api import context_parallel_attention, resolve_group, ring_attention, ulysses_attention  # noqa: F401
from .layout import BACKENDS, SequenceLayout, check_backend  # noqa: F401
