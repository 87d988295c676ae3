"""Attention across context-parallel ranks: layouts, masks, kernels, ring, Ulysses."""
from .api import (  # noqa: F401
    CPGroups, context_parallel_attention, hybrid_attention, resolve_group, resolve_groups, ring_attention,
    ulysses_attention,
)
from .layout import BACKENDS, SequenceLayout, check_backend, ulysses_size  # noqa: F401
from .mask import Documents, attention_work  # noqa: F401
from .rotation import ROTATIONS, check_rotation  # noqa: F401
