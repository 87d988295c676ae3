"""State I/O: checkpoints in Paddle's distributed format, full_state_dict, pretrained weights in and out."""
from .api import load_checkpoint, save_checkpoint, wait_checkpoint  # noqa: F401
from .commit import latest_checkpoint  # noqa: F401
