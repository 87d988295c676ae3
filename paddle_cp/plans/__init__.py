"""The public parallel plans, each a small class that validates and applies hooks."""
from .base import Plan  # noqa: F401
from .context_parallel import ContextParallel, PrepareContextParallel  # noqa: F401
