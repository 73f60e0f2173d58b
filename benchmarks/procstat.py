"""What /proc says: CPU seconds of a process and of the machine, bytes through an interface.

The cluster benchmarks read these to tell CPU contention from network time: the runner samples
each host's process and the machine as a whole, and a training worker counts its own CPU plus
that of the shards colocated on its host (``HostCpu``) and the bytes of its interface.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Mapping

__all__ = ["HOST_PIDS_ENV", "HostCpu", "iface_bytes", "machine_cpu_seconds", "own_threads_cpu_seconds",
           "proc_cpu_seconds", "resident_mb", "thread_cpu_seconds"]

# pids of the cgx-ps shards on a worker's host (shards.run_cgx sets it): HostCpu adds their CPU
# to the host's per step
HOST_PIDS_ENV = "CGX_PS_BENCH_HOST_PIDS"
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_cpu_seconds(stat: Path) -> float | None:
    """User + system CPU seconds from a /proc stat file (a process's or a thread's), None if gone."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15 of proc(5)


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), None if gone."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of a Python process's threads by group: the event loop (the main thread),
    gRPC's own threads (they name themselves) and Python's worker threads (kernels: a shard's
    executor and codec pool; Python does not name OS threads, so they are all "python")."""
    groups = {"event loop": 0.0, "kernel threads": 0.0, "gRPC threads": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended meanwhile
        seconds = _stat_cpu_seconds(task / "stat")
        if seconds is None:
            continue
        group = "event loop" if task.name == str(pid) else "kernel threads" if comm == "python" else "gRPC threads"
        groups[group] += seconds
    return groups


def own_threads_cpu_seconds() -> dict[str, float]:
    """CPU seconds of this process's threads by name, summed over threads of one name: Python's
    name where a Python thread runs there ("MainThread", "cgx-comm", "cgx-codec_0"), else the OS
    name the thread gave itself (gloo's, gRPC's, torch's pools). Where a step's CPU goes, thread by
    thread (Python does not name its OS threads, so /proc alone cannot tell them apart)."""
    named = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended meanwhile
        seconds = _stat_cpu_seconds(task / "stat")
        if seconds is not None:
            name = named.get(int(task.name), comm)
            out[name] = out.get(name, 0.0) + seconds
    return out


def resident_mb(pid: int) -> float:
    """Resident memory of process ``pid`` (VmRSS), MB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def machine_cpu_seconds(softirq: bool = False) -> tuple[float, ...]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat; with
    ``softirq`` also the irq + softirq part of busy (e.g. veth/tbf packet processing, which
    is not charged to any process's utime/stime)."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(v[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    out = ((total - v[3] - v[4]) / _CLK_TCK, total / _CLK_TCK)
    return out + ((v[5] + v[6]) / _CLK_TCK,) if softirq else out


def iface_bytes(iface: str | None) -> tuple[int, int] | None:
    """(rx_bytes, tx_bytes) of ``iface`` in this process's network namespace."""
    if not iface:
        return None
    try:
        with open("/proc/net/dev") as f:
            for line in f.readlines()[2:]:
                name, _, rest = line.partition(":")
                if name.strip() == iface:
                    v = rest.split()
                    return int(v[0]), int(v[8])
    except OSError:
        pass
    return None



class HostCpu:
    """CPU seconds of this process and of the other processes on its host (``HOST_PIDS_ENV``)
    between ``start()`` and ``stop()``: the CPU cost of the timed steps, per host."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        raw = (os.environ if env is None else env).get(HOST_PIDS_ENV, "")
        self.pids = [int(p) for p in raw.split(",") if p.strip()]
        self._start: tuple[float, list[float | None]] | None = None
        self._threads_start: dict[str, float] = {}
        self.own_s: float | None = None
        self.others_s: float | None = None
        self.threads_s: dict[str, float] = {}  # own CPU by thread name (own_threads_cpu_seconds)

    def _sample(self) -> tuple[float, list[float | None]]:
        return time.process_time(), [proc_cpu_seconds(p) for p in self.pids]

    def start(self) -> None:
        self._threads_start = own_threads_cpu_seconds()
        self._start = self._sample()

    def stop(self) -> None:
        if self._start is None:
            return
        own, others = self._sample()
        # a thread started meanwhile counts from 0; one ended meanwhile is missing here (not in own_s)
        self.threads_s = {name: s - self._threads_start.get(name, 0.0)
                          for name, s in own_threads_cpu_seconds().items()}
        self.own_s = own - self._start[0]
        pairs = list(zip(self._start[1], others))
        # a colocated process that is gone cannot be accounted for: no host figure then
        self.others_s = None if any(a is None or b is None for a, b in pairs) else sum(b - a for a, b in pairs)

    def per_step(self, steps: int) -> dict[str, float | None]:
        if self.own_s is None or steps <= 0:
            return {"cpu_s_per_step": None, "colocated_cpu_s_per_step": None, "host_cpu_s_per_step": None,
                    "thread_cpu_s_per_step": None}
        own = self.own_s / steps
        others = None if self.others_s is None else self.others_s / steps
        threads = {name: s / steps for name, s in sorted(self.threads_s.items(), key=lambda kv: -kv[1]) if s > 0}
        return {"cpu_s_per_step": own, "colocated_cpu_s_per_step": others,
                "host_cpu_s_per_step": None if others is None else own + others, "thread_cpu_s_per_step": threads}

