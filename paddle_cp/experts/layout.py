"""Which routed experts each position of an expert group holds: contiguous ranges, sizes differing by at most one
(the first `num_experts % size` positions hold one more)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLayout:
    num_experts: int
    size: int                   # positions in the expert group

    def __post_init__(self):
        if not 1 <= self.size <= self.num_experts:
            raise ValueError(f"cannot split {self.num_experts} experts over {self.size} ranks: every rank of an "
                             f"expert group holds at least one expert; choose ep_config degree <= {self.num_experts}")

    def range_of(self, position):
        """(start, stop) of the experts `position` holds."""
        base, extra = divmod(self.num_experts, self.size)
        start = position * base + min(position, extra)
        return start, start + base + (position < extra)

    @property
    def ranges(self):
        return [self.range_of(p) for p in range(self.size)]

    def owner(self, expert):
        return next(p for p, (start, stop) in enumerate(self.ranges) if start <= expert < stop)
