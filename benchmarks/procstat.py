"""What /proc says: CPU seconds of a process and of the machine, bytes through an interface.

The cluster benchmarks read these to tell CPU contention from network time: the runner samples
each host's process and the machine as a whole, and a training worker counts its own CPU plus
that of the shards colocated on its host (``HostCpu``) and the bytes of its interface.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping

__all__ = ["CPU_RESOLUTION_S", "HOST_PIDS_ENV", "HostCpu", "ThreadCpu", "cpu_by_group", "cpu_model", "cpu_ratio", "figure", "iface_bytes",
           "machine_cpu_seconds", "per_cpu", "proc_cpu_seconds", "proc_minor_faults", "resident_mb",
           "thread_cpu_seconds", "thread_cpu_snapshot"]

# pids of the cgx-ps shards on a worker's host (shards.run_cgx sets it): HostCpu adds their CPU
# to the host's per step
HOST_PIDS_ENV = "CGX_PS_BENCH_HOST_PIDS"
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc counts CPU in clock ticks (10 ms at the usual 100 Hz): a small workload's CPU over a few
# rounds can read 0 there, and a rate per CPU-second from it is a ZeroDivisionError or noise
CPU_RESOLUTION_S = 1 / _CLK_TCK


def per_cpu(amount: float, cpu_s: float) -> float | None:
    """``amount`` per CPU-second of ``cpu_s`` read from /proc (an input rate, or a ratio of two
    CPU times); None where ``cpu_s`` is under one clock tick: no CPU was measured to divide by."""
    return amount / cpu_s if cpu_s >= CPU_RESOLUTION_S else None


def cpu_ratio(a_s: float, b_s: float) -> float | None:
    """``a_s / b_s`` of two CPU times read from /proc; None unless both are at least one tick."""
    return per_cpu(a_s, b_s) if a_s >= CPU_RESOLUTION_S else None


def figure(value: float | None, spec: str, unit: str = "") -> str:
    """``value`` formatted by ``spec``, with ``unit``; "n/a" for a figure that was not measured."""
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _stat_fields(stat: Path) -> list[str] | None:
    """The fields of a /proc stat file after the name (proc(5)'s field N is index N - 3), None if gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    except (OSError, IndexError):
        return None


def _stat_cpu_seconds(stat: Path) -> float | None:
    """User + system CPU seconds from a /proc stat file (a process's or a thread's), None if gone."""
    fields = _stat_fields(stat)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), None if gone."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def proc_minor_faults(pid: int) -> int | None:
    """Minor page faults of process ``pid`` so far (all its threads; pages it touched for the
    first time since they were mapped: fresh memory the kernel zeroed), None if gone."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return None if fields is None else int(fields[7])  # field 10


def thread_cpu_snapshot(pid: int) -> dict[str, tuple[str, float]]:
    """Each thread of a Python process (by thread id): its group and its CPU seconds. Groups: the
    event loop (the main thread), gRPC's own threads (they name themselves) and Python's worker
    threads (kernels: a shard's executor and codec pool, its background kernel warm-up; Python does
    not name OS threads, so they are all "python")."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended meanwhile
        seconds = _stat_cpu_seconds(task / "stat")
        if seconds is None:
            continue
        group = "event loop" if task.name == str(pid) else "kernel threads" if comm == "python" else "gRPC threads"
        threads[task.name] = (group, seconds)
    return threads


def thread_cpu_seconds(pid: int, since: dict[str, tuple[str, float]] | None = None) -> dict[str, float]:
    """CPU seconds of a Python process's threads by group (``thread_cpu_snapshot``'s), or what each
    group spent after the snapshot ``since``: each thread's growth, so that a thread that ended in
    between (the shard's kernel warm-up, say) takes its earlier CPU with it instead of making a
    group's difference negative."""
    return cpu_by_group(thread_cpu_snapshot(pid), since)


def cpu_by_group(now: dict[str, tuple[str, float]], since: dict[str, tuple[str, float]] | None = None
                 ) -> dict[str, float]:
    """The groups' CPU seconds in the snapshot ``now``, or each thread's growth since ``since``
    summed by group: a thread gone from ``now`` counts for nothing."""
    groups = {"event loop": 0.0, "kernel threads": 0.0, "gRPC threads": 0.0}
    for tid, (group, seconds) in now.items():
        groups[group] += seconds - (since or {}).get(tid, (group, 0.0))[1]
    return groups


class ThreadCpu:
    """CPU seconds and minor page faults of this process's threads by role, between ``start()``
    and ``stop()``: where a worker's CPU per step goes. Python names its threads but not the OS
    threads (3.11), so the roles come from ``threading``'s names and native ids: the training
    thread (the main one: forward, backward, the front end's hooks, the optimizer), the
    communication thread (the engine's loop, ``cgx-comm``) and the codec threads (the engine's
    pool and the kernels' split, both ``cgx-codec*``); "other" is the rest of the process (gRPC's
    own threads, torch's), the process's total less the named threads. A thread that ends inside
    the window loses its share to "other"; one that starts inside it counts from zero. ``sys_s``:
    the system (kernel) part of each role's CPU: page faults in, and freeing (``munmap``) large
    tensors out, show there, not in a Python profile."""

    ROLES = (("training", "MainThread"), ("communication", "cgx-comm"), ("codec", "cgx-codec"))

    def __init__(self) -> None:
        self._start: dict[int, tuple[str, float, int, float]] | None = None
        self._start_total: tuple[float, int, float] | None = None
        self.cpu_s: dict[str, float] = {}
        self.sys_s: dict[str, float] = {}
        self.minflt: dict[str, int] = {}

    @classmethod
    def _role(cls, name: str) -> str | None:
        return next((role for role, prefix in cls.ROLES if name.startswith(prefix)), None)

    @staticmethod
    def _sample_stat(path: Path) -> tuple[float, int, float] | None:
        fields = _stat_fields(path)
        if fields is None:
            return None
        # utime+stime, minflt (field 10), stime
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK, int(fields[7]), int(fields[12]) / _CLK_TCK

    def _sample(self) -> tuple[dict[int, tuple[str, float, int, float]], tuple[float, int, float]]:
        import threading

        threads = {}
        for thread in threading.enumerate():
            role = self._role(thread.name)
            sample = self._sample_stat(Path(f"/proc/self/task/{thread.native_id}/stat")) if role else None
            if sample is not None:
                threads[thread.native_id] = (role, *sample)
        return threads, self._sample_stat(Path("/proc/self/stat")) or (0.0, 0, 0.0)

    def start(self) -> None:
        self._start, self._start_total = self._sample()

    def stop(self) -> None:
        if self._start is None or self._start_total is None:
            return
        end, end_total = self._sample()
        cpu = {role: 0.0 for role, _ in self.ROLES}
        faults = {role: 0 for role, _ in self.ROLES}
        sys_s = {role: 0.0 for role, _ in self.ROLES}
        for tid, (role, seconds, minflt, system) in end.items():
            _, seconds0, minflt0, system0 = self._start.get(tid, (role, 0.0, 0, 0.0))
            cpu[role] += seconds - seconds0
            faults[role] += minflt - minflt0
            sys_s[role] += system - system0
        cpu["other"] = end_total[0] - self._start_total[0] - sum(cpu.values())
        faults["other"] = end_total[1] - self._start_total[1] - sum(faults.values())
        sys_s["other"] = end_total[2] - self._start_total[2] - sum(sys_s.values())
        self.cpu_s, self.minflt, self.sys_s = cpu, faults, sys_s

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        if not self.cpu_s or steps <= 0:
            return {"thread_cpu_s_per_step": {}, "thread_minflt_per_step": {}, "thread_sys_s_per_step": {}}
        return {"thread_cpu_s_per_step": {role: s / steps for role, s in self.cpu_s.items()},
                "thread_minflt_per_step": {role: n / steps for role, n in self.minflt.items()},
                "thread_sys_s_per_step": {role: s / steps for role, s in self.sys_s.items()}}


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
        self.own_s: float | None = None
        self.others_s: float | None = None

    def _sample(self) -> tuple[float, list[float | None]]:
        return time.process_time(), [proc_cpu_seconds(p) for p in self.pids]

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> None:
        if self._start is None:
            return
        own, others = self._sample()
        self.own_s = own - self._start[0]
        pairs = list(zip(self._start[1], others))
        # a colocated process that is gone cannot be accounted for: no host figure then
        self.others_s = None if any(a is None or b is None for a, b in pairs) else sum(b - a for a, b in pairs)

    def per_step(self, steps: int) -> dict[str, float | None]:
        if self.own_s is None or steps <= 0:
            return {"cpu_s_per_step": None, "colocated_cpu_s_per_step": None, "host_cpu_s_per_step": None}
        own = self.own_s / steps
        others = None if self.others_s is None else self.others_s / steps
        return {"cpu_s_per_step": own, "colocated_cpu_s_per_step": others,
                "host_cpu_s_per_step": None if others is None else own + others}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), as BENCHMARKS.md names each machine."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"
