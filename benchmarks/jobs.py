"""The job runner of the emulated cluster: one script per host, one JSON line back from each.

``run_job`` is the generic runner (argv and env per host, a timeout, the last JSON line of each
host's stdout, CPU samples of each host's process and of the machine); ``run_ddp`` and
``run_single_process`` are thin wrappers over it for ``benchmarks/ddp_step.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from benchmarks.emulator import Cluster
from benchmarks.localjob import last_json_line
from benchmarks.netns import HOST_IFACE, PREFIX, kill_pids
from benchmarks.procstat import machine_cpu_seconds, proc_cpu_seconds

__all__ = ["PORTS", "JobResult", "ddp_argv", "repo_env", "run_ddp", "run_job", "run_single_process", "thread_env"]

HERE = Path(__file__).resolve().parent
DDP_STEP = HERE / "ddp_step.py"
REPO_ROOT = HERE.parent


@dataclass
class JobResult:
    name: str
    results: list[dict | None]        # the last JSON line of each host's stdout (None if none)
    returncodes: list[int | None]
    timed_out: bool
    wall_s: float
    stderr_tails: list[str] = field(default_factory=list)
    cpu_s: list[float | None] = field(default_factory=list)  # CPU seconds of each host's process (sampled)
    info: dict = field(default_factory=dict)  # machine_busy_s/machine_wall_s (all CPUs, whole job), extras

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes) and all(self.results)

    @property
    def status(self) -> str:
        if self.timed_out:
            return "timed out"
        if self.ok:
            return "ok"
        bad = [i for i, rc in enumerate(self.returncodes) if rc != 0]
        return f"failed (hosts {bad}: rc {[self.returncodes[i] for i in bad]})" if bad else "failed (no JSON)"


def run_job(
    cluster: Cluster,
    argv: Callable[[int], Sequence[str]] | Sequence[str],
    env: Callable[[int], Mapping[str, str]] | Mapping[str, str] | None = None,
    hosts: Sequence[int] | None = None,
    timeout: float = 120.0,
    name: str = "job",
) -> JobResult:
    """Start ``argv(i)`` with ``env(i)`` on every host i in ``hosts`` (default all),
    wait at most ``timeout`` seconds for all of them, kill what is left, and
    return each host's last JSON stdout line.  ``argv``/``env`` may also be
    plain values shared by all hosts."""
    hosts = list(range(cluster.hosts)) if hosts is None else list(hosts)
    argv_of = argv if callable(argv) else (lambda i: argv)
    env_of = env if callable(env) else (lambda i: env or {})
    procs, files = [], []
    cpu: list[float | None] = []
    busy0, _, irq0 = machine_cpu_seconds(softirq=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=PREFIX + "job-") as tmp:
        try:
            for i in hosts:
                out = open(os.path.join(tmp, f"{i}.out"), "w+")
                err = open(os.path.join(tmp, f"{i}.err"), "w+")
                files.append((out, err))
                procs.append(cluster.spawn(i, argv_of(i), env=env_of(i), stdout=out, stderr=err))
            cpu = [None] * len(procs)
            timed_out = False
            deadline = t0 + timeout
            while any(p.poll() is None for p in procs):
                for k, p in enumerate(procs):  # last sample before exit (up to 0.1 s short)
                    c = proc_cpu_seconds(p.pid) if p.returncode is None else None
                    cpu[k] = c if c is not None else cpu[k]
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                # one host failing makes the others wait forever in a collective
                if any(p.returncode not in (None, 0) for p in procs):
                    time.sleep(2)
                    break
                time.sleep(0.1)
        finally:
            kill_pids([p.pid for p in procs if p.poll() is None])
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        results, tails = [], []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            results.append(last_json_line(out.read()))
            tails.append(err.read()[-2000:])
            out.close()
            err.close()
    wall = time.monotonic() - t0
    busy1, _, irq1 = machine_cpu_seconds(softirq=True)
    return JobResult(name, results, [p.returncode for p in procs], timed_out, wall, tails, cpu,
                     {"machine_busy_s": busy1 - busy0, "machine_irq_s": irq1 - irq0, "machine_wall_s": wall})


# the MASTER_PORT of each job's process group: a fresh one per job, so a lingering socket of
# the last job cannot collide
PORTS = iter(range(29500, 29500 + 10000))


def ddp_argv(model: str, hook: str, steps: int, warmup: int, batch_size: int, threads: int, seed: int,
             timeout: float, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, str(DDP_STEP), "--model", model, "--hook", hook, "--steps", str(steps),
            "--warmup", str(warmup), "--batch-size", str(batch_size), "--threads", str(threads),
            "--seed", str(seed), "--iface", HOST_IFACE, "--timeout", str(int(timeout)), *extra]


def thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def run_ddp(cluster: Cluster, model: str = "mlp17m", hook: str = "none", steps: int = 20, warmup: int = 3,
            batch_size: int = 64, threads: int = 1, seed: int = 0, timeout: float = 180.0,
            extra_args: Sequence[str] = (), hosts: Sequence[int] | None = None) -> JobResult:
    """``ddp_step.py`` on every host (or on ``hosts``), one rank per host, gloo over the
    shaped links.  ``extra_args`` go to ddp_step.py as they are (e.g.
    ``["--bucket-cap-mb", "100"]``)."""
    port = next(PORTS)
    hosts = list(range(cluster.hosts)) if hosts is None else list(hosts)

    def env(i: int) -> dict[str, str]:
        return {"RANK": hosts.index(i), "WORLD_SIZE": len(hosts), "MASTER_ADDR": cluster.address(hosts[0]),
                "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": HOST_IFACE, **thread_env(threads)}

    argv = ddp_argv(model, hook, steps, warmup, batch_size, threads, seed, timeout, extra_args)
    return run_job(cluster, argv, env, hosts=hosts, timeout=timeout, name=f"ddp/{model}/{hook}")


def run_single_process(cluster: Cluster, model: str = "mlp17m", steps: int = 20, warmup: int = 3,
                       batch_size: int = 64, threads: int = 1, seed: int = 0, timeout: float = 180.0,
                       host: int = 0, extra_args: Sequence[str] = ()) -> JobResult:
    """``ddp_step.py`` with WORLD_SIZE=1 on one host: compute time without communication
    (``extra_args`` go to ddp_step.py as they are)."""
    env = {"RANK": 0, "WORLD_SIZE": 1, **thread_env(threads)}
    argv = ddp_argv(model, "none", steps, warmup, batch_size, threads, seed, timeout, extra_args)
    return run_job(cluster, argv, env, hosts=[host], timeout=timeout, name=f"single/{model}")



def repo_env(extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """Environment for a process that imports cgx_ps from this checkout."""
    path = os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else "")}
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env
