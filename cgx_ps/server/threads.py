"""How a shard spreads its kernel work over threads: blocks side by side, not one block split.

The shard's executor (main.ShardServer) runs the kernel work of each push and round, one block
per task: with a thread per core, the pushes and rounds of different blocks are checked and
summed side by side. A kernel call can also split one block's buckets over the kernels' own pool
(kernels.cpu._run_split). On top of an executor that already keeps every core busy, that split
only adds hand-offs: a submit, a wake-up and a wait per call, on a pool thread that competes
for the same cores (profile in BENCHMARKS.md, "One executor hop per push"). So a call is split
only over the cores the executor's threads leave over.
"""

from __future__ import annotations

import os

__all__ = ["executor_threads", "per_call_threads", "usable_cpus"]


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
