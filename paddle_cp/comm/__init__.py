"""The only code that calls paddle.distributed collectives."""
from . import autograd, collectives, counters, p2p  # noqa: F401
from .counters import bytes_sent, reset as reset_counters  # noqa: F401
