"""Token mixing across context-parallel ranks: layouts, masks, kernels, ring, Ulysses, state passing, halos."""
from .api import context_parallel_attention, hybrid_attention, ring_attention, ulysses_attention  # noqa: F401
from .groups import resolve_group, resolve_groups  # noqa: F401
from .layout import SequenceLayout, ulysses_size  # noqa: F401
from .mask import Documents, attention_work  # noqa: F401
from .rotation import check_rotation  # noqa: F401
