"""What the whole plan says about one ColWise layer: worked out by plan_annotation.py before
any plan applies, read by ColWiseParallel when it does (kept apart from both so neither
imports helpers from the other)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ColumnInfo:
    feeds_row_parallel: bool = False  # a RowWise sibling takes this layer's split output
    parts: tuple = None               # fused column sizes (q|k|v, gate|up); None for a plain weight


def set_column_info(layer, info):
    layer.pcp_column = info


def column_info(layer):
    return getattr(layer, "pcp_column", None) or ColumnInfo()
