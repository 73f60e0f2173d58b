"""Counter-based uniform random numbers for stochastic rounding.

r(seed, i) depends only on the seed and the element's index in the tensor, never on thread
count or launch shape, so the CPU kernel, the CUDA kernel and the reference produce the same
levels. The mixer is Chris Wellons' "lowbias32" (an integer hash with low bias), applied twice:

    s    = mix(seed_lo ^ mix(seed_hi))                       # once per call
    h(i) = mix(i_lo ^ s ^ mix(i_hi))                         # per element; mix(0) == 0
    r(i) = (h(i) >> 8) * 2**-24                              # exact float32 in [0, 1)

One round of lowbias32 per element keeps the CPU kernel vectorized (32-bit multiplies); the
``mix(i_hi)`` term only matters for tensors of more than 2**32 elements.

This module holds the numpy version (used by the reference and to derive ``s``); the CPU and
CUDA kernels inline the same arithmetic.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mix32", "seed_key", "uniforms"]

_M32 = np.uint64(0xFFFFFFFF)
C1 = 0x7FEB352D
C2 = 0x846CA68B


def mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32 on uint64 arrays holding 32-bit values (uint64 so products cannot overflow)."""
    x = x.astype(np.uint64) & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(C1)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(C2)) & _M32
    x ^= x >> np.uint64(16)
    return x


def _mix32_int(x: int) -> int:
    """``mix32`` of one value, in Python integers: a block's encode derives its key with it,
    where a dozen numpy calls on one-element arrays cost 50 us (about 1 ms of a worker's step)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * C1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * C2) & 0xFFFFFFFF
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """Fold a 64-bit seed into the 32-bit key ``s``."""
    seed &= (1 << 64) - 1
    return _mix32_int((seed & 0xFFFFFFFF) ^ _mix32_int(seed >> 32))


def uniforms(seed: int, start: int, count: int) -> np.ndarray:
    """float32 r(seed, i) for i in [start, start + count)."""
    idx = np.arange(start, start + count, dtype=np.uint64)
    s = np.uint64(seed_key(seed))
    h = mix32((idx & _M32) ^ s ^ mix32(idx >> np.uint64(32)))
    return ((h >> np.uint64(8)).astype(np.float32)) * np.float32(2.0**-24)
