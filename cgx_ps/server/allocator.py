"""The shard process's C allocator: freed buffers kept for the next round, not handed back.

A shard moves about 100 MB per round for 4 nodes x 100 MB at 4 bits (51 MB of pushes in, 51 MB
of results out), in messages of 0.5-1 MiB: gRPC's slices, the Python bytes of each message,
the frames of each result. All are freed within the round and needed again the next. glibc's
malloc, by default, gives the free memory at the top of a heap back to the kernel once more
than its trim threshold is free (a threshold that follows the largest chunk freed, so about
2 MiB here), and maps a larger request with mmap of its own: so every round's buffers came back
as fresh pages, each zeroed and faulted in by the kernel on its first write (about 3,400 minor
faults per round, py-spy showing ``madvise`` under the free of each read message).

``allocator_settings`` raises both thresholds: requests up to ``MMAP_THRESHOLD`` come from the
heaps, and up to ``TRIM_THRESHOLD`` of free memory stays with each heap. That caps what is kept,
and keeps only memory the shard already held at its peak, so the peak resident memory that
server/sizing.py's rule describes does not grow by it; what a shard holds between rounds does
(measured in BENCHMARKS.md, "The shard's result framed once").

Only for the shard process (``run_server``), whose memory is sized for this: a library must not
change its host process's allocator.
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "allocator_settings", "keep_freed_memory"]

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 16 << 20  # above gRPC's 8 MiB message limit: every message and block buffer from the heaps
TRIM_THRESHOLD = 64 << 20  # free memory a heap keeps: more than one round's messages of one thread


def allocator_settings(libc: str) -> dict[int, int]:
    """The mallopt settings for a shard on the C library ``libc`` (``platform.libc_ver()[0]``):
    glibc's thresholds, or none for another one (musl's malloc has neither threshold)."""
    if libc != "glibc":
        return {}
    # M_MMAP_THRESHOLD first: setting either one turns off glibc's dynamic thresholds
    return {_M_MMAP_THRESHOLD: MMAP_THRESHOLD, _M_TRIM_THRESHOLD: TRIM_THRESHOLD}


def keep_freed_memory() -> bool:
    """Apply ``allocator_settings`` to this process; False where they do not apply or mallopt refused one."""
    settings = allocator_settings(platform.libc_ver()[0])
    if not settings:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = all(mallopt(param, value) == 1 for param, value in settings.items())  # mallopt: 1 on success
    if not applied:
        log.warning("glibc refused the shard's malloc thresholds: freed buffers go back to the kernel every round")
    return applied
