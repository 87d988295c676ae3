"""Token mixing across context-parallel ranks: layouts, masks, kernels, ring, Ulysses, state passing, halos."""
from .dispatch.api import context_parallel_attention, hybrid_attention, ring_attention, ulysses_attention  # noqa: F401
from .dispatch.groups import resolve_group, resolve_groups  # noqa: F401
from .layout.sequence_layout import SequenceLayout, ulysses_size  # noqa: F401
from .masks.block_mask import Documents, attention_work  # noqa: F401
from .algorithms.rotation import check_rotation  # noqa: F401
