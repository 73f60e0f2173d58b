"""Flags in shared memory that other processes poll: stores with release and loads with acquire
semantics, so the data a flag announces is visible before the flag is.

x86-64 keeps stores in order on its own (TSO), but aarch64 hosts (Graviton CPU workers, Grace
GPU nodes) do not: without a barrier another process may see the flag raised and still read
the old data. A plain numpy store gives no ordering guarantee, so these go through numba with
an explicit sequentially consistent fence (``lock or`` on x86-64, ``dmb ish`` on aarch64).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

__all__ = ["store_release", "load_acquire"]


@intrinsic
def _fence(typingctx):
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@numba.njit(nogil=True, cache=True)
def _store(flags, index, value):
    _fence()  # everything written before (the block's data) is visible before the flag
    flags[index] = value


@numba.njit(nogil=True, cache=True)
def _load(flags, index):
    value = flags[index]
    _fence()  # what we read after seeing the flag is at least as new as the flag
    return value


def store_release(flags: np.ndarray, index: int, value: int) -> None:
    """``flags[index] = value`` after every earlier write of this thread."""
    _store(flags, index, value)


def load_acquire(flags: np.ndarray, index: int) -> int:
    """``flags[index]``, ordered before every later read of this thread."""
    return int(_load(flags, index))
