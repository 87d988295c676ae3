"""Per-process runtime state: what hooks and collectives record while a model runs.

One object, so a test (or a new training run in the same process) clears all of
it with one `reset()`. Configuration (meshes, process groups, parameter records)
is not runtime state and lives elsewhere.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class RuntimeState:
    sequence_split: bool = False  # is the sequence split over mp at this point of the forward?
    bytes_sent: defaultdict = field(default_factory=lambda: defaultdict(int))  # bytes this rank sent, by tag


state = RuntimeState()


def reset():
    """Forget everything recorded so far (in place: modules keep their reference to `state`)."""
    state.__dict__.update(RuntimeState().__dict__)
