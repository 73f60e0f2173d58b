"""cgx-ps shards inside the emulated hosts, and the cgx-ps training job against them.

``start_shards`` starts one ``cgx-ps server`` per listed host, on a free port read back from a
port file (the local cluster's launcher, ``cgx_ps.server.cluster``); the shards are ordinary spawned processes, so the cluster's teardown kills them on
every exit path too. ``run_cgx`` starts shards on ``shard_hosts`` (default: colocated, one per
worker host), runs ``benchmarks/cgx_step.py`` (or ``ddp_step.py --hook cgx``) on
``worker_hosts`` and stops the shards::

    with Cluster(hosts=4, rate="1gbit") as c:   # 2 worker hosts + 2 shard hosts
        res = run_cgx(c, "mlp17m", "4bit", worker_hosts=[0, 1], shard_hosts=[2, 3])
        print(res.results[0]["median_step_s"], res.info["shard_cpu_s"])
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Mapping, Sequence

from benchmarks.emulator import Cluster
from benchmarks.jobs import PORTS, REPO_ROOT, JobResult, ddp_argv, repo_env, run_job, thread_env
from benchmarks.netns import HOST_IFACE, PREFIX, ClusterError, kill_pids
from benchmarks.procstat import HOST_PIDS_ENV, proc_cpu_seconds
from cgx_ps.net.security import new_token_file
from cgx_ps.server.cluster import STARTUP_TIMEOUT_S, launch_shard, wait_for_port_file

__all__ = ["FRONT_ENDS", "ShardSet", "run_cgx", "start_shards"]

CGX_STEP = Path(__file__).resolve().with_name("cgx_step.py")


class ShardSet:
    """cgx-ps shard processes, shard k on host ``hosts[k]`` (a host may hold several).

    Each shard binds its host's address on a free port.  The processes are
    spawned through ``Cluster.spawn``, so ``Cluster.close`` kills them on every
    exit path even if ``stop`` never runs; ``stop`` asks them to drain first.
    """

    def __init__(self, cluster: Cluster, hosts: Sequence[int], procs: list[subprocess.Popen],
                 addresses: list[str], tmp: tempfile.TemporaryDirectory) -> None:
        self.cluster = cluster
        self.hosts = list(hosts)
        self.procs = procs
        self.addresses = addresses
        self._tmp = tmp
        self.returncodes: list[int | None] = []
        self._last_cpu: dict[int, float] = {}  # pid -> last CPU seconds seen
        self.token_file = ""  # the job token the shards require (CGX_PS_TOKEN_FILE for workers)

    @property
    def servers(self) -> str:
        """The value of CGX_PS_SERVERS."""
        return ",".join(self.addresses)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def cpu_seconds(self) -> list[float | None]:
        """CPU seconds each shard has used so far (the last value seen once it exited)."""
        for p in self.procs:
            c = proc_cpu_seconds(p.pid) if p.poll() is None else None
            if c is not None:
                self._last_cpu[p.pid] = c
        return [self._last_cpu.get(p.pid) for p in self.procs]

    def log_tail(self, k: int, chars: int = 2000) -> str:
        try:
            return (Path(self._tmp.name) / f"shard{k}.log").read_text()[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> list[int | None]:
        """SIGTERM (the shards drain), then SIGKILL after ``timeout``; returns exit codes."""
        self.cpu_seconds()
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        kill_pids([p.pid for p in self.procs if p.poll() is None], grace_s=2.0)
        for p in self.procs:
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        self.returncodes = [p.returncode for p in self.procs]
        return self.returncodes

    def close(self) -> None:
        """Stop (if running) and remove the port files and logs."""
        if any(self.alive()):
            self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> "ShardSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_shards(cluster: Cluster, hosts: Sequence[int], extra_args: Sequence[str] = (),
                 env: Mapping[str, object] | None = None, startup_timeout: float = STARTUP_TIMEOUT_S) -> ShardSet:
    """Start one ``cgx-ps server`` per entry of ``hosts`` (shard k on host ``hosts[k]``),
    wait until each serves, and return them.  ``extra_args`` go to every server
    (default log level WARNING, metrics off, a short drain on SIGTERM).  The start-up is the
    local cluster's (``cgx_ps.server.cluster.launch_shard``, port-file handshake), each
    shard spawned inside its host's network namespace."""
    hosts = list(hosts)
    if not hosts:
        raise ValueError("start_shards needs at least one host")
    for h in hosts:
        cluster._check_index(h)
    # the run's prefix in the folder (and so in every shard's --port-file): tells this run's shards
    # from those of a run with another CGX_PS_NETNS_PREFIX on the same machine
    tmp = tempfile.TemporaryDirectory(prefix=PREFIX + "shards-")
    procs: list[subprocess.Popen] = []
    shards = ShardSet(cluster, hosts, procs, [], tmp)
    shards.token_file = new_token_file(tmp.name)  # shards listen beyond loopback: require a job token
    try:
        port_files = []
        for k, h in enumerate(hosts):
            port_files.append(Path(tmp.name) / f"shard{k}.json")
            flags = ["--host", cluster.address(h), "--port", "0", "--shard-index", str(k),
                     "--num-shards", str(len(hosts)), "--metrics-port", "-1", "--log-level", "WARNING",
                     "--drain-timeout", "2", "--token-file", shards.token_file, *extra_args]
            log = open(Path(tmp.name) / f"shard{k}.log", "w")
            try:
                procs.append(launch_shard(flags, port_files[k], partial(cluster.spawn, h), env=repo_env(env),
                                          stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT)))
            finally:
                log.close()  # the child holds its own descriptor
        deadline = time.monotonic() + startup_timeout
        for k, (p, port_file) in enumerate(zip(procs, port_files)):
            try:
                port = wait_for_port_file(p, port_file, deadline)["port"]
            except (RuntimeError, TimeoutError) as exc:
                raise ClusterError(f"shard {k} on host {hosts[k]} {exc}:\n{shards.log_tail(k)}") from None
            shards.addresses.append(f"{cluster.address(hosts[k])}:{port}")
    except BaseException:
        shards.close()
        raise
    return shards


def _cgx_argv(model: str, compression: str, steps: int, warmup: int, batch_size: int, threads: int, seed: int,
              extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, str(CGX_STEP), "--model", model, "--compression", compression, "--steps", str(steps),
            "--warmup", str(warmup), "--batch-size", str(batch_size), "--threads", str(threads),
            "--seed", str(seed), "--iface", HOST_IFACE, *extra]


FRONT_ENDS = ("optimizer", "optimizer-group", "ddp-hook")


def run_cgx(cluster: Cluster, model: str = "mlp17m", compression: str = "4bit", steps: int = 20, warmup: int = 3,
            batch_size: int = 64, threads: int = 1, seed: int = 0, timeout: float = 180.0,
            worker_hosts: Sequence[int] | None = None, shard_hosts: Sequence[int] | None = None,
            extra_args: Sequence[str] = (), shard_args: Sequence[str] = (),
            front_end: str = "optimizer", worker_env: Mapping[str, str] | None = None) -> JobResult:
    """``cgx_step.py`` on ``worker_hosts`` (default all hosts), one worker (= one node)
    per host, against fresh shards on ``shard_hosts`` (default: the worker hosts,
    i.e. one colocated shard per worker host).  The shards are stopped before
    returning.  ``res.info`` holds the shard hosts and addresses, each shard's CPU
    seconds during the job (``shard_cpu_s``), the machine's busy CPU seconds and
    wall time of the job (``machine_busy_s``, ``machine_wall_s``), and shard exit codes.

    ``front_end="ddp-hook"`` runs ``ddp_step.py --hook cgx`` instead: torch DDP over a gloo
    process group on the same links, its buckets averaged by the cgx-ps DDP comm hook through
    the same shards (``extra_args`` go to ddp_step.py, e.g. ``["--block-mb", "4"]``).
    ``front_end="optimizer-group"``: ``cgx_step.py --process-group``, the optimizer with a gloo
    group on the same links for auto mode's uncompressed steps. ``worker_env``: more variables
    for every worker (say ``CGX_PS_DATAPLANE``)."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"front_end {front_end!r}: choose from {FRONT_ENDS}")
    worker_hosts = list(range(cluster.hosts)) if worker_hosts is None else list(worker_hosts)
    shard_hosts = list(worker_hosts) if shard_hosts is None else list(shard_hosts)
    hook = front_end == "ddp-hook"
    group = front_end in ("ddp-hook", "optimizer-group")  # the workers also form a gloo group
    name = f"{'ddp-cgx' if hook else 'cgx'}/{model}/{compression}"
    port = next(PORTS)
    with start_shards(cluster, shard_hosts, extra_args=shard_args) as shards:
        job_id = f"{name}-{uuid.uuid4().hex[:8]}"

        def env(i: int) -> dict[str, str]:
            rank = worker_hosts.index(i)
            # the shards on this worker's host: the worker adds their CPU to its host's per step
            colocated = ",".join(str(p.pid) for h, p in zip(shards.hosts, shards.procs) if h == i)
            return repo_env({"RANK": rank, "WORLD_SIZE": len(worker_hosts), "CGX_PS_NODE_RANK": rank,
                              "CGX_PS_NUM_NODES": len(worker_hosts), "CGX_PS_SERVERS": shards.servers,
                              "CGX_PS_TOKEN_FILE": shards.token_file, HOST_PIDS_ENV: colocated,
                              "CGX_PS_JOB_ID": job_id, **thread_env(threads),
                              # DDP's own gloo group (for the broadcast at wrap time and barriers),
                              # or the optimizer's for auto mode's uncompressed steps
                              **({"MASTER_ADDR": cluster.address(worker_hosts[0]), "MASTER_PORT": port,
                                  "GLOO_SOCKET_IFNAME": HOST_IFACE} if group else {}),
                              **(worker_env or {})})

        if hook:
            argv = ddp_argv(model, "cgx", steps, warmup, batch_size, threads, seed, timeout,
                             ["--compression", compression, *extra_args])
        else:
            argv = _cgx_argv(model, compression, steps, warmup, batch_size, threads, seed,
                             [*extra_args, *(["--process-group"] if group else [])])
        cpu0 = shards.cpu_seconds()
        res = run_job(cluster, argv, env, hosts=worker_hosts, timeout=timeout, name=name)
        cpu1 = shards.cpu_seconds()
        alive = shards.alive()
        codes = shards.stop()
        res.info.update({
            "shard_hosts": shard_hosts, "servers": shards.addresses,
            "shard_cpu_s": [None if a is None or b is None else b - a for a, b in zip(cpu0, cpu1)],
            "shards_alive_at_end": alive, "shard_returncodes": codes,
            "shard_log_tails": [shards.log_tail(k) for k in range(len(shard_hosts))] if not res.ok else [],
        })
    return res
