"""Checkpoints in Paddle's distributed-checkpoint format: save, resume on any layout, export."""
from .api import load_checkpoint, save_checkpoint, wait_checkpoint  # noqa: F401
from .commit import latest_checkpoint  # noqa: F401
