"""How many threads a worker's codec work gets: sized for the host, not for an idle machine.

A worker runs, besides training's torch threads: one communication thread (the engine's asyncio
loop: gRPC streams, no heavy work), a pool of codec threads (``CommEngine.executor``: how many
blocks are encoded or decoded at once) and, inside one CPU codec call, the kernels' own split
(``kernels.cpu.set_num_threads``). Encoding overlaps backward, and a shard on the same host
(BytePS's colocated layout) sums every node's pushes on a core of its own. Codec threads beyond
the cores nobody else wants only preempt backward and the shard: the last blocks then leave later
and every worker waits for the slowest shard. ``plan_threads`` gives the codec work the spare
cores, at least one thread, and at most two blocks at once (one decoding while the next encodes;
more adds contention, not overlap). ``CGX_PS_CODEC_THREADS`` overrides it (docs/configuration.md).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Sequence

import torch

from ...kernels import cpu as cpu_kernels

__all__ = ["ThreadPlan", "plan_threads", "apply_thread_plan", "host_thread_plan", "local_shards"]


@dataclass(frozen=True)
class ThreadPlan:
    """Codec threads of one worker process."""

    codec_workers: int  # blocks encoded/decoded at once (the engine's executor)
    kernel_threads: int  # threads one CPU codec call splits its buckets over
    reason: str  # how the numbers were reached, for logs and the docs


def plan_threads(cpus: int, torch_threads: int, local_ranks: int = 1, local_shards: int = 0,
                 override: int = 0) -> ThreadPlan:
    """Codec threads for one of ``local_ranks`` worker processes on a host of ``cpus`` usable
    cores, each training on ``torch_threads``, beside ``local_shards`` shard processes.

    ``override`` > 0 (``CGX_PS_CODEC_THREADS``): that many codec threads in all. Otherwise the
    spare cores, ``cpus - local_ranks * torch_threads - local_shards``, shared among the local
    ranks, at least one each. The threads go first to a second block in flight, then to the
    split of a single call."""
    if override > 0:
        total, why = override, f"CGX_PS_CODEC_THREADS={override}"
    else:
        spare = cpus - local_ranks * torch_threads - local_shards
        total = max(1, spare // max(1, local_ranks))
        why = (f"{cpus} cpus - {local_ranks} rank(s) x {torch_threads} torch thread(s) - {local_shards} local "
               f"shard(s) = {spare} spare")
    workers = min(2, total)
    return ThreadPlan(workers, max(1, total // workers), why)


def local_shards(servers: Sequence[str]) -> int:
    """How many of the shard addresses are on this host: an address this host can bind to
    (loopback, or one of its own interfaces: a network namespace's too). Name lookups that fail
    count as remote."""
    count = 0
    for address in servers:
        host = address.rsplit(":", 1)[0].strip("[]")
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            continue
        for family, kind, proto, _, sockaddr in infos:
            try:
                with socket.socket(family, kind, proto) as probe:
                    probe.bind((sockaddr[0], 0))
            except OSError:
                continue
            count += 1
            break
    return count


def host_thread_plan(servers: Sequence[str], local_ranks: int, override: int) -> ThreadPlan:
    """``plan_threads`` for this process: its CPU affinity, torch's thread count now."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    shards = local_shards(servers) if override <= 0 else 0
    return plan_threads(cpus, torch.get_num_threads(), local_ranks, shards, override)


def apply_thread_plan(plan: ThreadPlan) -> None:
    """The kernels' split is process-wide: set it (the engine's pool takes ``codec_workers``)."""
    cpu_kernels.set_num_threads(plan.kernel_threads)
