"""paddle_cp: context-parallel training for PaddlePaddle, behind Paddle's `parallelize` API."""
from .attention import ring_attention, ulysses_attention
from .comm import bytes_sent, reset_counters
from .config import load_config
from .mesh import get_mesh, set_mesh
from .parallelize import parallelize
from .plans import ContextParallel, PrepareContextParallel
from .sequence import sequence_positions, shard_sequence, unshard_sequence

__version__ = "0.1.0"

__all__ = [
    "parallelize", "set_mesh", "get_mesh",
    "PrepareContextParallel", "ContextParallel",
    "ring_attention", "ulysses_attention",
    "shard_sequence", "unshard_sequence", "sequence_positions",
    "bytes_sent", "reset_counters", "load_config",
]
