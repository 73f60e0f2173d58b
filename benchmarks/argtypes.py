"""argparse types for the benchmarks' numbers: a value that cannot make a run (0 rounds, 0 nodes,
a gradient of no elements, 9 bits) is a usage error naming the flag, not a traceback after the
shards have started (as in cgx_ps/cli/commands.py, whose types are the command's own)."""

from __future__ import annotations

import argparse
import math
from typing import Callable

__all__ = ["at_least", "bits", "fp32_megabytes", "fraction", "non_negative"]


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def bits(text: str) -> int:
    """An argparse type: a quantization width the codec has, 1..8."""
    value = int(text)
    if not 1 <= value <= 8:
        raise argparse.ArgumentTypeError(f"must be in 1..8, got {value}")
    return value


def fp32_megabytes(text: str) -> float:
    """An argparse type: megabytes (1e6 bytes) of fp32 that hold at least one element."""
    value = float(text)
    if not math.isfinite(value) or int(value * 1e6 / 4) < 1:
        raise argparse.ArgumentTypeError(f"must hold at least one fp32 element (>= 4e-06), got {text}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1] (a scale factor)."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def non_negative(text: str) -> float:
    """An argparse type: a finite number >= 0 (a duration)."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value
