"""How a shard spreads its kernel work over threads: blocks side by side, not one block split.

The shard's executor (main.ShardServer) runs the kernel work of each push and round, one block
per task: with a thread per core, the pushes and rounds of different blocks are checked and
summed side by side. A kernel call can also split one block's buckets over the kernels' own pool
(kernels.cpu._run_split). On top of an executor that already keeps every core busy, that split
only adds hand-offs: a submit, a wake-up and a wait per call, on a pool thread that competes
for the same cores (py-spy of the shard under benchmarks/server.py). So a call is split
only over the cores the executor's threads leave over.

The hop to the executor has its own price: a submit, a futex wake of an executor thread, the
GIL passed back and forth, and a call back into the event loop to resume the push. A push that
does not complete its round is only checked (crc32, header, metadata) and kept: for a
compressed block of up to 1 MiB that costs less CPU than the hop itself, so it is kept on the
event loop, and only the push completing a round (the summing kernel) goes to a kernel
thread (``keeps_on_loop``; benchmarks/aggregator.py times the hand-offs).
"""

from __future__ import annotations

import os

__all__ = ["INLINE_KEEP_BYTES", "executor_threads", "keeps_on_loop", "per_call_threads", "usable_cpus"]

# Largest push kept on the event loop: checking 1 MiB (crc32 at ~10 GB/s, the metadata) takes ~0.15 ms of it
INLINE_KEEP_BYTES = 1 << 20


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def executor_threads(configured: int, cpus: int) -> int:
    """Threads of the shard's kernel executor: ``--kernel-threads``, or one per CPU when it is 0."""
    return configured if configured > 0 else cpus


def per_call_threads(configured: int, cpus: int) -> int:
    """Threads one summing kernel call may split a block over: the CPUs per executor thread
    (1 when the executor has a thread per CPU; 2 with ``--kernel-threads 1`` on 2 CPUs)."""
    return max(1, cpus // executor_threads(configured, cpus))


def keeps_on_loop(payload_bytes: int, only_checked: bool, completes_round: bool) -> bool:
    """Is a push checked and kept on the event loop rather than in a hop to a kernel thread?
    Only one that does not complete its round, whose keeping is a check and nothing more
    (``EncodedSum.keeps``), of at most ``INLINE_KEEP_BYTES``: anything that decodes or sums
    stays off the event loop, which must keep reading every stream."""
    return only_checked and not completes_round and payload_bytes <= INLINE_KEEP_BYTES
