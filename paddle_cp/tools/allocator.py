"""Paddle's host allocator statistics (bytes held in tensors): what the tools' memory figures read.

Paddle is imported when they are called, so a tool's command line parses without it."""
from __future__ import annotations


def _core():
    from paddle.base import core

    return core


def allocated():
    """Bytes Paddle's host allocator holds in tensors now."""
    return _core().host_memory_stat_current_value("Allocated", 0)


def reset_peak():
    """Start a new peak at what is held now."""
    _core().host_memory_stat_reset_peak_value("Allocated", 0)


def peak():
    """The most bytes held since the last reset_peak()."""
    return _core().host_memory_stat_peak_value("Allocated", 0)
