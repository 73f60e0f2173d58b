"""Fused, multithreaded CPU kernels of the max-min codec (numba, GIL released).

One pass reads each input element once for min/max and once for the levels (the bucket is still
in L1/L2), and writes packed bytes directly: no intermediate tensors. Buckets are independent, so
a call is split into contiguous bucket ranges that run on a small thread pool; every kernel is
compiled with ``nogil=True`` so these threads (and a server's own executor threads) run truly in
parallel. We avoid numba's ``parallel=True``: its default threading layer aborts when two Python
threads launch parallel kernels at once, which is exactly what a server does.

Arithmetic is float32 in the reference's order with no fast-math contraction, so the bytes match
``reference.py`` exactly.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from . import rng

__all__ = ["encode_maxmin_into", "decode_maxmin_into", "num_threads", "set_num_threads"]

_M32 = np.uint64(0xFFFFFFFF)
_MIN_BUCKETS_PER_THREAD = 64  # below ~64K elements a thread hop costs more than it saves


@numba.njit(inline="always")
def _mix32(x):
    x = x & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(rng.C1)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(rng.C2)) & _M32
    x ^= x >> np.uint64(16)
    return x


@numba.njit(nogil=True, cache=True, fastmath={"nnan", "ninf", "nsz"})
def _minmax(x, start, end):
    # fast-math lets LLVM vectorize the reductions; callers reject non-finite input first.
    mn = x[start]
    mx = x[start]
    for i in range(start + 1, end):
        v = x[i]
        mn = min(mn, v)
        mx = max(mx, v)
    return mn, mx


@numba.njit(nogil=True, cache=True)
def _first_nonfinite(bits_i32, start, end):
    """Index of the first NaN/Inf in [start, end), or -1 (integer test on the float's bits)."""
    bad = 0
    for i in range(start, end):
        bad |= (bits_i32[i] & 0x7F800000) == 0x7F800000
    if bad:
        for i in range(start, end):
            if (bits_i32[i] & 0x7F800000) == 0x7F800000:
                return i
    return -1


@numba.njit(nogil=True, cache=True)
def _encode_range(x, xbits, meta, packed, bits, bucket_size, stochastic, seed_key, b0, b1, status):
    """Encode buckets [b0, b1). status[0] = first bad element index (or -1), status[1] = bucket
    whose range overflowed (or -1)."""
    n = x.shape[0]
    max_level = np.float32((1 << bits) - 1)
    half = np.float32(0.5)
    zero = np.float32(0.0)
    inv24 = np.float32(2.0**-24)
    levels = np.empty(bucket_size, dtype=np.uint8)
    s = np.uint64(seed_key)
    for b in range(b0, b1):
        start = b * bucket_size
        end = min(start + bucket_size, n)
        bad = _first_nonfinite(xbits, start, end)
        if bad >= 0:
            status[0] = bad
            return
        mn, mx = _minmax(x, start, end)
        unit = np.float32(mx - mn) / max_level
        if not np.isfinite(unit):
            status[1] = b
            return
        scale = np.float32(1.0) / unit if unit > zero else zero
        meta[2 * b] = mn
        meta[2 * b + 1] = unit
        m = end - start
        if stochastic:
            for i in range(m):
                idx = np.uint64(start + i)
                h = _mix32(_mix32((idx & _M32) ^ s) ^ (idx >> np.uint64(32)))
                r = np.float32(h >> np.uint64(8)) * inv24
                t = np.floor((x[start + i] - mn) * scale + r)
                levels[i] = np.uint8(min(max(t, zero), max_level))
        else:
            for i in range(m):
                t = np.floor((x[start + i] - mn) * scale + half)
                levels[i] = np.uint8(min(max(t, zero), max_level))
        _pack_bucket(levels, m, packed, (start * bits) // 8, bits)


@numba.njit(inline="always")
def _pack_bucket(levels, m, out, byte0, bits):
    # Eight levels of `bits` bits fill exactly `bits` bytes: build them in a u64, store bytes.
    p = byte0
    groups = m // 8
    for g in range(groups):
        v = np.uint64(0)
        for k in range(8):
            v |= np.uint64(levels[8 * g + k]) << np.uint64(k * bits)
        for j in range(bits):
            out[p + j] = np.uint8((v >> np.uint64(8 * j)) & np.uint64(0xFF))
        p += bits
    rem = m - groups * 8
    if rem:
        v = np.uint64(0)
        for k in range(rem):
            v |= np.uint64(levels[8 * groups + k]) << np.uint64(k * bits)
        for j in range((rem * bits + 7) // 8):
            out[p + j] = np.uint8((v >> np.uint64(8 * j)) & np.uint64(0xFF))


@numba.njit(nogil=True, cache=True)
def _decode_range(meta, packed, out, accumulate, numel, bits, bucket_size, b0, b1, status):
    """Decode buckets [b0, b1) into out, or add into it. The caller has validated meta."""
    mask = np.uint64((1 << bits) - 1)
    for b in range(b0, b1):
        mn = meta[2 * b]
        unit = meta[2 * b + 1]
        start = b * bucket_size
        end = min(start + bucket_size, numel)
        p = (start * bits) // 8
        i = start
        while i < end:
            k_end = min(8, end - i)
            v = np.uint64(0)
            for j in range((k_end * bits + 7) // 8):
                v |= np.uint64(packed[p + j]) << np.uint64(8 * j)
            for k in range(k_end):
                level = np.float32((v >> np.uint64(k * bits)) & mask)
                y = mn + unit * level
                if accumulate:
                    out[i + k] += y
                else:
                    out[i + k] = y
            p += bits
            i += 8


# ---- threading ---------------------------------------------------------------------------------

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_threads = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def num_threads() -> int:
    return _threads


def set_num_threads(n: int) -> None:
    """Threads one CPU codec call may use (default: the CPUs this process may run on)."""
    global _threads, _pool
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    with _pool_lock:
        _threads = n
        if _pool is not None:
            _pool.shutdown(wait=False)
            _pool = None


def _get_pool() -> ThreadPoolExecutor:
    # Created on first use, never at import: importing the codecs must not start threads.
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, _threads - 1), thread_name_prefix="cgx-codec")
        return _pool


def _run_split(fn, nbuckets: int, args: tuple, status: np.ndarray) -> None:
    """Run fn(*args, b0, b1, status_row) over bucket ranges; the caller's thread takes one."""
    parts = max(1, min(_threads, nbuckets // _MIN_BUCKETS_PER_THREAD))
    if parts == 1:
        fn(*args, 0, nbuckets, status[0])
        return
    edges = [nbuckets * k // parts for k in range(parts + 1)]
    pool = _get_pool()
    futures = [pool.submit(fn, *args, edges[k], edges[k + 1], status[k]) for k in range(1, parts)]
    fn(*args, edges[0], edges[1], status[0])
    for f in futures:
        f.result()


def encode_maxmin_into(
    x: np.ndarray, meta: np.ndarray, packed: np.ndarray, bits: int, bucket_size: int,
    stochastic: bool, seed: int,
) -> tuple[int, int]:
    """Encode float32 x into meta (float32, 2 per bucket) and packed (uint8).

    Returns (first non-finite element index or -1, first overflowing bucket or -1)."""
    n = x.shape[0]
    if n == 0:
        return -1, -1
    nb = -(-n // bucket_size)
    status = np.full((_threads, 2), -1, dtype=np.int64)
    key = rng.seed_key(seed) if stochastic else 0
    args = (x, x.view(np.int32), meta, packed, bits, bucket_size, stochastic, key)
    _run_split(_encode_range, nb, args, status)
    bad = status[:, 0][status[:, 0] >= 0]
    over = status[:, 1][status[:, 1] >= 0]
    return (int(bad.min()) if bad.size else -1), (int(over.min()) if over.size else -1)


def decode_maxmin_into(
    meta: np.ndarray, packed: np.ndarray, out: np.ndarray, accumulate: bool, bits: int,
    bucket_size: int,
) -> None:
    """Decode into float32 out (or add into it). meta must already be validated."""
    n = out.shape[0]
    if n == 0:
        return
    nb = -(-n // bucket_size)
    status = np.full((_threads, 1), -1, dtype=np.int64)
    args = (meta, packed, out, accumulate, n, bits, bucket_size)
    _run_split(_decode_range, nb, args, status)
