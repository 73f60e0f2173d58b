"""Fused, multithreaded CPU kernels of the max-min codec (numba, GIL released).

One pass reads each input element once for min/max and once for the levels (the bucket is still
in L1/L2), and writes packed bytes directly: no intermediate tensors. Buckets are independent, so
a call is split into contiguous bucket ranges that run on a small thread pool; every kernel is
compiled with ``nogil=True`` so these threads (and a server's own executor threads) run truly in
parallel. We avoid numba's ``parallel=True``: its default threading layer aborts when two Python
threads launch parallel kernels at once, which is exactly what a server does.

The loops are in ``cpu_loops`` (one kernel per bit width, compiled on its first use) and
``cpu_packing``; this module checks arguments and splits calls over threads.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from . import rng
from .cpu_loops import decode_kernel, encode_kernel, first_bad_meta_kernel, first_nonfinite_kernel, sum_kernel

__all__ = ["encode_maxmin_into", "decode_maxmin_into", "sum_maxmin_into", "first_bad_meta", "first_nonfinite",
           "num_threads", "set_num_threads"]

_MIN_BUCKETS_PER_THREAD = 64  # below ~64K elements a thread hop costs more than it saves


def first_bad_meta(meta: np.ndarray, bits: int) -> int:
    """The first bucket whose (min, unit) pair in ``meta`` (float32, 2 per bucket, from the wire)
    is not finite, has unit < 0, or whose top level ``min + unit * (2**bits - 1)`` is not finite
    in float32; -1 if none. A payload's metadata may sit at any byte offset: an unaligned one is
    copied first (8 bytes per bucket), so one compiled kernel serves every payload."""
    if not meta.flags.aligned:
        meta = meta.copy()
    return int(first_bad_meta_kernel(meta, np.float32((1 << bits) - 1)))


_EXPONENT_MASKS = {"<f4": (np.int32, 0x7F800000), "<f2": (np.int16, 0x7C00), "bf16": (np.int16, 0x7F80)}


def first_nonfinite(bits: np.ndarray, kind: str) -> int:
    """First NaN/Inf element of float data given as raw bytes/ints; kind: '<f4', '<f2', 'bf16'."""
    dtype, mask = _EXPONENT_MASKS[kind]
    if bits.size == 0:
        return -1
    return int(first_nonfinite_kernel(bits.view(dtype), dtype(mask)))


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
        # Not shut down: a call in flight on another thread still submits to it. Its threads
        # exit once the last such call drops it (ThreadPoolExecutor's own clean-up).
        _pool = None


def _pool_and_threads() -> tuple[ThreadPoolExecutor, int]:
    """The pool and the thread count it was made for, read together (set_num_threads may run
    on another thread). Created on first use, never at import: importing must not start threads."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, _threads - 1), thread_name_prefix="cgx-codec")
        return _pool, _threads


def _run_split(fn, nbuckets: int, args: tuple, columns: int, threads: int | None = None) -> np.ndarray:
    """Run fn(*args, b0, b1, status_row) over bucket ranges, the caller's thread taking one;
    the status rows (``columns`` int64 each, -1 where nothing was flagged). ``threads``: at most
    that many ranges (None: ``num_threads()``)."""
    pool, default_threads = _pool_and_threads()
    parts = max(1, min(default_threads if threads is None else threads, nbuckets // _MIN_BUCKETS_PER_THREAD))
    status = np.full((parts, columns), -1, dtype=np.int64)
    if parts == 1:
        fn(*args, 0, nbuckets, status[0])
        return status
    edges = [nbuckets * k // parts for k in range(parts + 1)]
    futures = [pool.submit(fn, *args, edges[k], edges[k + 1], status[k]) for k in range(1, parts)]
    fn(*args, edges[0], edges[1], status[0])
    for f in futures:
        f.result()
    return status


def _first_flagged(status: np.ndarray) -> tuple[int, int]:
    """(first bucket holding NaN/Inf or -1, first overflowing bucket or -1) over every part."""
    bad = status[:, 0][status[:, 0] >= 0]
    over = status[:, 1][status[:, 1] >= 0]
    return (int(bad.min()) if bad.size else -1), (int(over.min()) if over.size else -1)


def encode_maxmin_into(
    x: np.ndarray, meta: np.ndarray, packed: np.ndarray, bits: int, bucket_size: int,
    stochastic: bool, seed: int,
) -> tuple[int, int]:
    """Encode float32 x into meta (float32, 2 per bucket) and packed (uint8).

    Returns (first bucket holding NaN/Inf or -1, first overflowing bucket or -1)."""
    n = x.shape[0]
    if n == 0:
        return -1, -1
    nb = -(-n // bucket_size)
    key = rng.seed_key(seed) if stochastic else 0
    args = (x, x.view(np.int32), meta, packed, bucket_size, stochastic, key)
    return _first_flagged(_run_split(encode_kernel(bits), nb, args, 2))


def decode_maxmin_into(
    meta: np.ndarray, packed: np.ndarray, out: np.ndarray, accumulate: bool, bits: int,
    bucket_size: int, scale: float = 1.0,
) -> None:
    """Decode into float32 out (or add into it). meta must already be validated. ``scale``
    (not with accumulate): multiply the decoded values by float32(scale), bit for bit as
    ``torch.Tensor.mul_(scale)`` would afterwards."""
    if accumulate and scale != 1.0:
        raise ValueError("scale is for a plain decode, not an accumulating one")
    n = out.shape[0]
    if n == 0:
        return
    nb = -(-n // bucket_size)
    args = (meta, packed, out, accumulate, n, bucket_size, np.float32(scale), scale != 1.0)
    _run_split(decode_kernel(bits), nb, args, 1)


def sum_maxmin_into(
    levels: Sequence[np.ndarray], metas: np.ndarray, numel: int, bits: int, bucket_size: int,
    acc: np.ndarray | None, from_acc: bool, out: tuple[np.ndarray, np.ndarray] | None,
    residual: np.ndarray | None, stochastic: bool, seed: int, threads: int | None = None,
) -> tuple[int, int]:
    """Sum validated max-min pushes of these settings, after ``acc`` if ``from_acc``: push k's
    packed levels are ``levels[k]`` (uint8, read where they are: a shard passes the payloads as
    received) and its (min, unit) pairs ``metas[k]`` (float32). With ``out`` (meta, packed),
    encode the sum there (with ``residual``: error feedback, updated in place) and return what
    encode_maxmin_into returns; without, store the sum into ``acc``. The result is bit-identical
    to decoding the pushes one by one into an accumulator, then encoding it, however many
    ``threads`` (None: ``num_threads()``) the buckets are split over."""
    if numel == 0:
        return -1, -1
    if not levels and not from_acc:
        raise ValueError("nothing to sum: no pushes and no partial sum")
    nb = -(-numel // bucket_size)
    need = (numel * bits + 7) // 8
    # the kernel reads each push's levels through a raw pointer: every bound is checked here
    for lv in levels:
        if lv.dtype != np.uint8 or lv.ndim != 1 or not lv.flags.c_contiguous or lv.size < need:
            raise ValueError(f"levels must be contiguous uint8 arrays of at least {need} bytes, got "
                             f"{lv.dtype} {lv.shape}")
    if metas.dtype != np.float32 or metas.ndim != 2 or metas.shape[0] < len(levels) or metas.shape[1] < 2 * nb \
            or not metas.flags.c_contiguous:
        raise ValueError(f"metas must be a contiguous float32 array of at least ({len(levels)}, {2 * nb})")
    levels_at = np.array([lv.ctypes.data for lv in levels] or [0], dtype=np.uint64)
    meta, packed = out if out is not None else (_NO_F32, _NO_U8)
    key = rng.seed_key(seed) if stochastic and out is not None else 0
    args = (levels_at, metas, len(levels), numel, bucket_size,
            acc if acc is not None else _NO_F32, from_acc, out is not None,
            residual if residual is not None else _NO_F32, residual is not None, meta, packed, stochastic, key)
    # levels stays referenced (this frame) until every part of the call has returned
    return _first_flagged(_run_split(sum_kernel(bits), nb, args, 2, threads))


_NO_F32 = np.empty(0, dtype=np.float32)  # placeholders: numba needs typed arrays for unused args
_NO_U8 = np.empty(0, dtype=np.uint8)
