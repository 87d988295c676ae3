"""Lengths in tokens as the tools read and print them: a plain count or a K/M suffix, K = 1024 and M = 1024^2
(the convention of context lengths: 128K = 131072 tokens, 4M = 4194304)."""
from __future__ import annotations

import argparse
import re

TOKEN_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2}
UNITS_HELP = "K = 1024, M = 1024^2 tokens"


def tokens(text):
    """An argparse type: '131072', '128K', '4M', '1.5M' (a whole number of tokens) -> int."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length in tokens: give a count or a count with K or M "
                                         f"({UNITS_HELP}), e.g. 131072 or 128K")
    value = float(match.group(1)) * TOKEN_UNITS[match.group(2).upper()]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens ({UNITS_HELP})")
    return int(value)


def format_tokens(count):
    """`count` tokens in the largest unit it reaches, to two decimals where inexact: 131072 -> '128K',
    4325376 -> '4.12M'."""
    for suffix in ("M", "K"):
        unit = TOKEN_UNITS[suffix]
        if count >= unit:
            return f"{count // unit}{suffix}" if count % unit == 0 else f"{count / unit:.2f}{suffix}"
    return str(count)
