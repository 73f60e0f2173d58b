"""The shard process's C allocator: freed buffers kept for the next round, not handed back.

A shard moves about 100 MB per round for 4 nodes x 100 MB at 4 bits (51 MB of pushes in, 51 MB
of results out), in messages of 0.5-1 MiB: gRPC's slices, the Python bytes of each message,
the frames of each result. All are freed within the round and needed again the next. glibc's
malloc, by default, gives the free memory at the top of a heap back to the kernel once more
than its trim threshold is free (a threshold that follows the largest chunk freed, so about
2 MiB here), and maps a larger request with mmap of its own: so every round's buffers came back
as fresh pages, each zeroed and faulted in by the kernel on its first write (11-15k minor faults
per round, py-spy showing ``madvise`` under the free of each read message).

``allocator_settings`` raises both thresholds: requests up to ``MMAP_THRESHOLD`` come from the
heaps, and up to ``TRIM_THRESHOLD`` of free memory stays with each heap. That caps what is kept,
and keeps only memory the shard already held at its peak, so the peak resident memory that
server/process/sizing.py's rule describes grows at most by what each thread's heap keeps: measured, no
change beyond the run-to-run spread of an attack at the caps (+/- 70 MiB at M = 256 MiB), and up to
+80 MiB of peak after 20 honest rounds of 4 nodes x 100 MB; between rounds a shard now holds about
70 MB more, for x1.14-1.20 less CPU per round (benchmarks/shard_allocator.py).

Only for the shard process (``run_server``), whose memory is sized for this: a library must not
change its host process's allocator. An operator's own malloc settings (glibc's ``MALLOC_*_``
variables or a malloc tunable in ``GLIBC_TUNABLES``) stand: the shard then sets nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from typing import Mapping

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "allocator_settings", "keep_freed_memory"]

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 16 << 20  # above gRPC's 8 MiB message limit: every message and block buffer from the heaps
# Free memory a heap keeps. benchmarks/shard_allocator.py, 4 nodes x 100 MB: 16 MiB still faulted
# 0.8-3k pages per round, 32 and 64 MiB 0.4-1.3k (glibc's defaults 11-15k) for the same CPU; a
# thread's heap may keep its peak's free memory up to this, so the smaller of the two
TRIM_THRESHOLD = 32 << 20


def allocator_settings(libc: str, env: Mapping[str, str]) -> dict[int, int]:
    """The mallopt settings for a shard on the C library ``libc`` (``platform.libc_ver()[0]``)
    started with the environment ``env``: glibc's thresholds; none for another C library (musl's
    malloc has neither threshold), nor where the environment already tunes glibc's malloc."""
    if libc != "glibc" or _operator_tuned(env):
        return {}
    # M_MMAP_THRESHOLD first: setting either one turns off glibc's dynamic thresholds
    return {_M_MMAP_THRESHOLD: MMAP_THRESHOLD, _M_TRIM_THRESHOLD: TRIM_THRESHOLD}


def _operator_tuned(env: Mapping[str, str]) -> bool:
    """Does ``env`` set glibc's malloc already (read by glibc at start, before any mallopt)?"""
    return any(name.startswith("MALLOC_") and name.endswith("_") for name in env) or \
        "glibc.malloc." in env.get("GLIBC_TUNABLES", "")


def keep_freed_memory() -> bool:
    """Apply ``allocator_settings`` to this process; False where none apply or mallopt refused one."""
    settings = allocator_settings(platform.libc_ver()[0], os.environ)
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
