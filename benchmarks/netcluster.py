#!/usr/bin/env python3
"""A commodity-cluster emulator on one Linux machine, for benchmarks.

``Cluster(hosts=H, rate="1gbit")`` builds H "hosts", each a network namespace
(``cgxb-h0``, ``cgxb-h1``, ...) whose ``eth0`` is one end of a veth pair.  The
other ends are ports of the bridge ``cgxb-br0``, which lives in its own
namespace ``cgxb-sw`` (the "switch"), so nothing is added to the root
namespace.  Host i has the address 10.77.0.(i+1)/24.  Every host link is
shaped BOTH ways with a token-bucket filter: egress of the host's ``eth0``
(host -> switch) and egress of the switch port (switch -> host).

Processes are started on a host with ``Cluster.spawn`` (``ip netns exec``).
Namespaces, the bridge and every spawned process are removed on every exit
path: normal exit, exception, SIGINT, SIGTERM (handlers turn them into
exceptions, so the ``finally``/``__exit__`` runs) and, as a backstop, atexit.

A second cluster never starts over leftovers of an earlier run: any ``cgxb-``
namespace or link makes ``Cluster`` refuse, naming the command that removes
them (``python benchmarks/netcluster.py --cleanup``).  ``CGX_PS_NETNS_PREFIX`` (default
``cgxb-``) gives a run a prefix of its own, so runs by different people on one machine neither
collide nor count as each other's leftovers; ``--cleanup`` removes that prefix's objects only.

CLI (needs root)::

    python benchmarks/netcluster.py --hosts 2 --rate 1gbit --measure
    python benchmarks/netcluster.py --hosts 2 --rate 1gbit --ddp --model mlp17m --steps 20
    python benchmarks/netcluster.py --cleanup

Library::

    with Cluster(hosts=2, rate="1gbit") as c:
        print(measure_link(c))                      # Gbit/s host0 -> host1
        res = run_ddp(c, "mlp17m", "fp16", steps=20)

``run_job`` is the generic runner (one script per host, env per host, gather
one JSON line per host, timeout); ``run_ddp`` and ``run_single_process`` are
thin wrappers over it for ``benchmarks/ddp_step.py``.

cgx-ps shards are long-running processes started inside host namespaces with
``start_shards`` (one ``cgx-ps server`` per listed host, on a free port read
back from a port file); they are ordinary spawned processes, so the cluster's
teardown kills them on every exit path too.  ``run_cgx`` starts shards on
``shard_hosts`` (default: colocated, one per worker host), runs
``benchmarks/cgx_step.py`` on ``worker_hosts`` and stops the shards::

    with Cluster(hosts=4, rate="1gbit") as c:   # 2 worker hosts + 2 shard hosts
        res = run_cgx(c, "mlp17m", "4bit", worker_hosts=[0, 1], shard_hosts=[2, 3])
        print(res.results[0]["median_step_s"], res.info["shard_cpu_s"])
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

__all__ = [
    "PREFIX",
    "ClusterConfig",
    "Cluster",
    "ClusterError",
    "NotRootError",
    "LeftoversError",
    "JobResult",
    "find_leftovers",
    "cleanup_leftovers",
    "cleanup_command",
    "parse_rate",
    "tbf_params",
    "measure_link",
    "run_job",
    "run_ddp",
    "run_single_process",
    "ShardSet",
    "start_shards",
    "run_cgx",
    "proc_cpu_seconds",
    "machine_cpu_seconds",
    "main",
]

# Every namespace and link starts with this; CGX_PS_NETNS_PREFIX gives a run its own (two people
# benchmarking on one machine must not see each other's hosts as leftovers). At most 8 characters:
# Linux link names are 15 at most, and the longest here is PREFIX + "p" + a host number.
PREFIX = os.environ.get("CGX_PS_NETNS_PREFIX", "cgxb-")
if not (0 < len(PREFIX) <= 8 and all(c.isascii() and (c.isalnum() or c == "-") for c in PREFIX)):
    raise SystemExit(f"CGX_PS_NETNS_PREFIX={PREFIX!r}: use 1-8 ASCII letters, digits or '-'")
SWITCH_NS = PREFIX + "sw"
BRIDGE = PREFIX + "br0"
HOST_IFACE = "eth0"
SUBNET = "10.77.0"
HERE = Path(__file__).resolve().parent
DDP_STEP = HERE / "ddp_step.py"
CGX_STEP = HERE / "cgx_step.py"
REPO_ROOT = HERE.parent
# pids of the cgx-ps shards on a worker's host: ddp_step.HostCpu adds their CPU to the host's per step
HOST_PIDS_ENV = "CGX_PS_BENCH_HOST_PIDS"


# --------------------------------------------------------------------------
# errors and small helpers
# --------------------------------------------------------------------------


class ClusterError(RuntimeError):
    """An ``ip``/``tc`` command failed, or the cluster cannot be used."""


class NotRootError(ClusterError):
    """Namespaces and qdiscs need root (CAP_NET_ADMIN + CAP_SYS_ADMIN)."""


class LeftoversError(ClusterError):
    """``cgxb-`` namespaces or links of an earlier run still exist."""


def cleanup_command() -> str:
    """The exact shell command that removes leftovers of an earlier run."""
    script = Path(__file__).resolve()
    try:
        script = script.relative_to(Path.cwd())
    except ValueError:
        pass
    return f"{sys.executable} {script} --cleanup"


def _require_root() -> None:
    if os.geteuid() != 0:
        raise NotRootError(
            "netcluster needs root (it creates network namespaces, veth pairs, a bridge "
            "and tc qdiscs); rerun as root, e.g. sudo " + " ".join([sys.executable] + sys.argv)
        )
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise ClusterError("netcluster needs the iproute2 tools `ip` and `tc` on PATH")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"command failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr.strip()}")
    return proc


_RATE_UNITS = {  # tc(8) units: SI prefixes; "bps" means bytes per second
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}


def parse_rate(rate: str | int | float) -> int:
    """``"1gbit"`` -> 1_000_000_000 (bits per second), following tc(8) units."""
    if isinstance(rate, (int, float)):
        return int(rate)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", rate)
    if not m or m.group(2).lower() not in _RATE_UNITS | {"": 1}:
        raise ValueError(f"unrecognised rate {rate!r} (use e.g. 100mbit, 1gbit, 10gbit)")
    return int(float(m.group(1)) * _RATE_UNITS.get(m.group(2).lower(), 1))


def tbf_params(rate_bps: int, burst_ms: float, latency_ms: float) -> tuple[int, int]:
    """(burst, limit) in bytes for a tbf at ``rate_bps``.

    The bucket holds ``burst_ms`` worth of tokens but never less than 128 KiB:
    veth hands tbf GSO super-packets of up to 64 KiB, and a packet larger than
    the bucket is split into MTU segments (slow) or dropped.  The queue holds
    ``latency_ms`` worth of bytes on top of the bucket.
    """
    rate_Bps = rate_bps / 8
    burst = max(128 * 1024, int(rate_Bps * burst_ms / 1e3))
    limit = burst + max(2 * 65536, int(rate_Bps * latency_ms / 1e3))
    return burst, limit


# --------------------------------------------------------------------------
# leftovers
# --------------------------------------------------------------------------


def _netns_names() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _root_link_names() -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():  # "3: cgxb-p0@if2: <...>"
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def find_leftovers() -> dict[str, list[str]]:
    """``{"netns": [...], "links": [...]}``: ``cgxb-`` objects that exist now."""
    return {
        "netns": [n for n in _netns_names() if n.startswith(PREFIX)],
        "links": [n for n in _root_link_names() if n.startswith(PREFIX)],
    }


def _kill_pids(pids: Sequence[int], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``, each pid given (by id)."""
    pids = [p for p in pids if p > 1 and p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _pid_alive(p)]
            time.sleep(0.05)
        pids = alive


def _pid_alive(pid: int) -> bool:
    """True unless the process is gone or a zombie.  Zombies are not reaped
    here, so that Popen.wait() still sees the real exit status."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _netns_pids(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def cleanup_leftovers(verbose: bool = False) -> dict[str, list[str]]:
    """Remove every ``cgxb-`` namespace (after killing the processes inside it)
    and every ``cgxb-`` link of the root namespace.  Returns what was removed."""
    _require_root()
    found = find_leftovers()
    for ns in found["netns"]:
        _kill_pids(_netns_pids(ns))
    for ns in sorted(found["netns"], key=lambda n: n == SWITCH_NS):  # hosts first
        _run("ip", "netns", "delete", ns, check=False)
        if verbose:
            print(f"removed netns {ns}")
    for link in found["links"]:
        _run("ip", "link", "delete", link, check=False)
        if verbose:
            print(f"removed link {link}")
    return found


# --------------------------------------------------------------------------
# the cluster
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterConfig:
    hosts: int = 2
    rate: str = "1gbit"        # per host link, each direction (tc units)
    burst_ms: float = 2.0      # token bucket depth, in ms of line rate (>= 128 KiB)
    latency_ms: float = 5.0    # queue depth beyond the bucket, in ms of line rate
    mtu: int = 1500
    disable_ipv6: bool = True  # no router solicitations etc. in the byte counters

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 250:
            raise ValueError("hosts must be in 1..250")
        parse_rate(self.rate)

    @property
    def rate_bps(self) -> int:
        return parse_rate(self.rate)


_LIVE: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


@atexit.register
def _close_live_clusters() -> None:
    for c in list(_LIVE):
        c.close()


class _Terminated(SystemExit):
    """Raised by the SIGTERM handler so ``finally`` blocks run."""


class Cluster:
    """H namespaces on one bridge, each link shaped to ``rate`` both ways."""

    def __init__(self, hosts: int = 2, rate: str = "1gbit", config: ClusterConfig | None = None, **kw):
        self.config = config or ClusterConfig(hosts=hosts, rate=rate, **kw)
        self.procs: list[subprocess.Popen] = []
        self._up = False
        self._closed = False
        self._old_handlers: dict[int, object] = {}

    # ---- naming -----------------------------------------------------------
    @property
    def hosts(self) -> int:
        return self.config.hosts

    def netns(self, i: int) -> str:
        return f"{PREFIX}h{i}"

    def address(self, i: int) -> str:
        self._check_index(i)
        return f"{SUBNET}.{i + 1}"

    def iface(self, i: int) -> str:  # the host's interface, inside its namespace
        return HOST_IFACE

    def switch_port(self, i: int) -> str:  # the bridge port of host i, in SWITCH_NS
        return f"{PREFIX}p{i}"

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.hosts:
            raise IndexError(f"host {i} out of range 0..{self.hosts - 1}")

    # ---- lifecycle --------------------------------------------------------
    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Cluster":
        _require_root()
        left = find_leftovers()
        if left["netns"] or left["links"]:
            what = ", ".join(left["netns"] + left["links"])
            raise LeftoversError(
                f"leftovers of an earlier netcluster run exist ({what}); remove them with:\n"
                f"    {cleanup_command()}"
            )
        _LIVE.add(self)
        self._install_signal_handlers()
        self._up = True  # from here on, close() has something to undo
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        cfg = self.config
        burst, limit = tbf_params(cfg.rate_bps, cfg.burst_ms, cfg.latency_ms)
        tbf = ["tbf", "rate", cfg.rate, "burst", str(burst), "limit", str(limit)]
        _run("ip", "netns", "add", SWITCH_NS)
        _run("ip", "-n", SWITCH_NS, "link", "set", "lo", "up")
        _run("ip", "-n", SWITCH_NS, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _run("ip", "-n", SWITCH_NS, "link", "set", BRIDGE, "up")
        for i in range(cfg.hosts):
            ns, port = self.netns(i), self.switch_port(i)
            _run("ip", "netns", "add", ns)
            if cfg.disable_ipv6:
                _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                     "net.ipv6.conf.default.disable_ipv6=1")
            # both ends are created directly inside their namespaces
            _run("ip", "link", "add", HOST_IFACE, "netns", ns, "mtu", str(cfg.mtu), "type", "veth",
                 "peer", "name", port, "netns", SWITCH_NS, "mtu", str(cfg.mtu))
            _run("ip", "-n", SWITCH_NS, "link", "set", port, "master", BRIDGE)
            _run("ip", "-n", SWITCH_NS, "link", "set", port, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", HOST_IFACE)
            _run("ip", "-n", ns, "link", "set", HOST_IFACE, "up")
            _run("tc", "-n", ns, "qdisc", "replace", "dev", HOST_IFACE, "root", *tbf)     # host -> switch
            _run("tc", "-n", SWITCH_NS, "qdisc", "replace", "dev", port, "root", *tbf)  # switch -> host

    def close(self) -> None:
        """Kill spawned processes, remove namespaces and bridge.  Idempotent."""
        if self._closed or not self._up:
            self._closed = True
            self._restore_signal_handlers()
            return
        self._closed = True
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:  # a second Ctrl-C must not interrupt the teardown
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            _kill_pids([p.pid for p in self.procs if p.poll() is None])
            for p in self.procs:
                try:
                    p.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
            names = [self.netns(i) for i in range(self.hosts)] + [SWITCH_NS]
            for ns in names:  # anything else still running inside (grandchildren)
                _kill_pids(_netns_pids(ns))
            for ns in names:
                _run("ip", "netns", "delete", ns, check=False)
        finally:
            _LIVE.discard(self)
            self._restore_signal_handlers()
            if in_main:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    # ---- signals ------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # atexit + the caller's finally still clean up

        def on_term(signum, frame):
            raise _Terminated(128 + signum)

        def on_int(signum, frame):
            raise KeyboardInterrupt

        self._old_handlers = {
            signal.SIGTERM: signal.signal(signal.SIGTERM, on_term),
            signal.SIGINT: signal.signal(signal.SIGINT, on_int),
        }

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._old_handlers = {}

    # ---- processes ------------------------------------------------------------
    def spawn(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen_kw) -> subprocess.Popen:
        """Start ``argv`` on host ``i`` (``ip netns exec``); returns the Popen.

        ``env`` is added to this process's environment.  The child gets its own
        session so that Ctrl-C in a terminal reaches only us; ``close`` kills it.
        """
        self._check_index(i)
        if not self._up or self._closed:
            raise ClusterError("cluster is not running")
        full_env = dict(os.environ)
        full_env.update({k: str(v) for k, v in (env or {}).items()})
        popen_kw.setdefault("start_new_session", True)
        p = subprocess.Popen(["ip", "netns", "exec", self.netns(i), *map(str, argv)], env=full_env, **popen_kw)
        self.procs.append(p)
        return p

    def tx_bytes(self, i: int) -> int:
        """Bytes sent so far by host i's interface."""
        p = _run("ip", "netns", "exec", self.netns(i), "cat", f"/sys/class/net/{HOST_IFACE}/statistics/tx_bytes")
        return int(p.stdout)


# --------------------------------------------------------------------------
# link measurement (plain Python TCP)
# --------------------------------------------------------------------------

_CHUNK = 1 << 20


def _sink_main(host: str, port: int) -> None:
    """Accept one connection, read until EOF, print {"bytes", "seconds"}."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    total, t0 = 0, None
    while True:
        n = conn.recv_into(view)
        if n == 0:
            break
        if t0 is None:
            t0 = time.perf_counter()
            n = 0  # the clock starts after the first read
        total += n
    dt = time.perf_counter() - (t0 or time.perf_counter())
    conn.close()
    print(json.dumps({"bytes": total, "seconds": dt}), flush=True)


def _source_main(host: str, port: int, seconds: float) -> None:
    """Connect (retrying briefly), send for ``seconds``, then close."""
    deadline = time.monotonic() + 10
    while True:
        try:
            s = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = memoryview(os.urandom(_CHUNK))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
    s.close()


def measure_link(cluster: Cluster, src: int = 0, dst: int = 1, seconds: float = 2.0, port: int = 5201) -> float:
    """Throughput in Gbit/s of one TCP stream from host ``src`` to host ``dst``,
    measured by the receiver from its first read to EOF."""
    me = str(Path(__file__).resolve())
    sink = cluster.spawn(dst, [sys.executable, me, "--_sink", cluster.address(dst), str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if sink.stdout.readline().strip() != "ready":
            raise ClusterError(f"link sink failed: {sink.stderr.read()}")
        source = cluster.spawn(src, [sys.executable, me, "--_source", cluster.address(dst), str(port), str(seconds)],
                               stderr=subprocess.PIPE, text=True)
        _, err = source.communicate(timeout=seconds + 30)
        if source.returncode != 0:
            raise ClusterError(f"link source failed: {err}")
        out, err = sink.communicate(timeout=30)
        if sink.returncode != 0:
            raise ClusterError(f"link sink failed: {err}")
    finally:
        for p in (sink,):
            if p.poll() is None:
                _kill_pids([p.pid])
    r = json.loads(out.strip().splitlines()[-1])
    return r["bytes"] * 8 / r["seconds"] / 1e9


# --------------------------------------------------------------------------
# generic runner: one script per host, gather one JSON line per host
# --------------------------------------------------------------------------


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


def _last_json_line(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


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
    with tempfile.TemporaryDirectory(prefix="cgxb-job-") as tmp:
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
            _kill_pids([p.pid for p in procs if p.poll() is None])
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        results, tails = [], []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            results.append(_last_json_line(out.read()))
            tails.append(err.read()[-2000:])
            out.close()
            err.close()
    wall = time.monotonic() - t0
    busy1, _, irq1 = machine_cpu_seconds(softirq=True)
    return JobResult(name, results, [p.returncode for p in procs], timed_out, wall, tails, cpu,
                     {"machine_busy_s": busy1 - busy0, "machine_irq_s": irq1 - irq0, "machine_wall_s": wall})


_port_counter = iter(range(29500, 29500 + 10000))


def _ddp_argv(model: str, hook: str, steps: int, warmup: int, batch_size: int, threads: int, seed: int,
              timeout: float, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, str(DDP_STEP), "--model", model, "--hook", hook, "--steps", str(steps),
            "--warmup", str(warmup), "--batch-size", str(batch_size), "--threads", str(threads),
            "--seed", str(seed), "--iface", HOST_IFACE, "--timeout", str(int(timeout)), *extra]


def _thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def run_ddp(cluster: Cluster, model: str = "mlp17m", hook: str = "none", steps: int = 20, warmup: int = 3,
            batch_size: int = 64, threads: int = 1, seed: int = 0, timeout: float = 180.0,
            extra_args: Sequence[str] = (), hosts: Sequence[int] | None = None) -> JobResult:
    """``ddp_step.py`` on every host (or on ``hosts``), one rank per host, gloo over the
    shaped links.  ``extra_args`` go to ddp_step.py as they are (e.g.
    ``["--bucket-cap-mb", "100"]``)."""
    port = next(_port_counter)
    hosts = list(range(cluster.hosts)) if hosts is None else list(hosts)

    def env(i: int) -> dict[str, str]:
        return {"RANK": hosts.index(i), "WORLD_SIZE": len(hosts), "MASTER_ADDR": cluster.address(hosts[0]),
                "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": HOST_IFACE, **_thread_env(threads)}

    argv = _ddp_argv(model, hook, steps, warmup, batch_size, threads, seed, timeout, extra_args)
    return run_job(cluster, argv, env, hosts=hosts, timeout=timeout, name=f"ddp/{model}/{hook}")


def run_single_process(cluster: Cluster, model: str = "mlp17m", steps: int = 20, warmup: int = 3,
                       batch_size: int = 64, threads: int = 1, seed: int = 0, timeout: float = 180.0,
                       host: int = 0) -> JobResult:
    """``ddp_step.py`` with WORLD_SIZE=1 on one host: compute time without communication."""
    env = {"RANK": 0, "WORLD_SIZE": 1, **_thread_env(threads)}
    argv = _ddp_argv(model, "none", steps, warmup, batch_size, threads, seed, timeout)
    return run_job(cluster, argv, env, hosts=[host], timeout=timeout, name=f"single/{model}")


# --------------------------------------------------------------------------
# CPU accounting (to tell CPU contention from network time)
# --------------------------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15 of proc(5)


def machine_cpu_seconds(softirq: bool = False) -> tuple[float, ...]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat; with
    ``softirq`` also the irq + softirq part of busy (e.g. veth/tbf packet processing, which
    is not charged to any process's utime/stime)."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(v[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    out = ((total - v[3] - v[4]) / _CLK_TCK, total / _CLK_TCK)
    return out + ((v[5] + v[6]) / _CLK_TCK,) if softirq else out


# --------------------------------------------------------------------------
# cgx-ps: shard processes inside host namespaces, and the training runner
# --------------------------------------------------------------------------


def _repo_env(extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """Environment for a process that imports cgx_ps from this checkout."""
    path = os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else "")}
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


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
        _kill_pids([p.pid for p in self.procs if p.poll() is None], grace_s=2.0)
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
                 env: Mapping[str, object] | None = None, startup_timeout: float = 60.0) -> ShardSet:
    """Start one ``cgx-ps server`` per entry of ``hosts`` (shard k on host ``hosts[k]``),
    wait until each serves, and return them.  ``extra_args`` go to every server
    (default log level WARNING, metrics off, a short drain on SIGTERM)."""
    hosts = list(hosts)
    if not hosts:
        raise ValueError("start_shards needs at least one host")
    for h in hosts:
        cluster._check_index(h)
    tmp = tempfile.TemporaryDirectory(prefix="cgxb-shards-")
    procs: list[subprocess.Popen] = []
    shards = ShardSet(cluster, hosts, procs, [], tmp)
    from cgx_ps.security import new_token_file

    shards.token_file = new_token_file(tmp.name)  # shards listen beyond loopback: require a job token
    try:
        port_files = []
        for k, h in enumerate(hosts):
            port_file = Path(tmp.name) / f"shard{k}.json"
            port_files.append(port_file)
            argv = [sys.executable, "-m", "cgx_ps.cli", "server", "--host", cluster.address(h), "--port", "0",
                    "--shard-index", str(k), "--num-shards", str(len(hosts)), "--metrics-port", "-1",
                    "--port-file", str(port_file), "--log-level", "WARNING", "--drain-timeout", "2",
                    "--token-file", shards.token_file, *extra_args]
            log = open(Path(tmp.name) / f"shard{k}.log", "w")
            try:
                procs.append(cluster.spawn(h, argv, env=_repo_env(env), stdout=log, stderr=subprocess.STDOUT,
                                           cwd=str(REPO_ROOT)))
            finally:
                log.close()  # the child holds its own descriptor
        deadline = time.monotonic() + startup_timeout
        for k, (p, port_file) in enumerate(zip(procs, port_files)):
            while not port_file.exists():
                if p.poll() is not None:
                    raise ClusterError(f"shard {k} on host {hosts[k]} exited with code {p.returncode} during "
                                       f"startup:\n{shards.log_tail(k)}")
                if time.monotonic() > deadline:
                    raise ClusterError(f"shard {k} on host {hosts[k]} did not serve within {startup_timeout}s:\n"
                                       f"{shards.log_tail(k)}")
                time.sleep(0.05)
            port = json.loads(port_file.read_text())["port"]
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


FRONT_ENDS = ("optimizer", "ddp-hook")


def run_cgx(cluster: Cluster, model: str = "mlp17m", compression: str = "4bit", steps: int = 20, warmup: int = 3,
            batch_size: int = 64, threads: int = 1, seed: int = 0, timeout: float = 180.0,
            worker_hosts: Sequence[int] | None = None, shard_hosts: Sequence[int] | None = None,
            extra_args: Sequence[str] = (), shard_args: Sequence[str] = (),
            front_end: str = "optimizer") -> JobResult:
    """``cgx_step.py`` on ``worker_hosts`` (default all hosts), one worker (= one node)
    per host, against fresh shards on ``shard_hosts`` (default: the worker hosts,
    i.e. one colocated shard per worker host).  The shards are stopped before
    returning.  ``res.info`` holds the shard hosts and addresses, each shard's CPU
    seconds during the job (``shard_cpu_s``), the machine's busy CPU seconds and
    wall time of the job (``machine_busy_s``, ``machine_wall_s``), and shard exit codes.

    ``front_end="ddp-hook"`` runs ``ddp_step.py --hook cgx`` instead: torch DDP over a gloo
    process group on the same links, its buckets averaged by the cgx-ps DDP comm hook through
    the same shards (``extra_args`` go to ddp_step.py, e.g. ``["--block-mb", "4"]``)."""
    import uuid

    if front_end not in FRONT_ENDS:
        raise ValueError(f"front_end {front_end!r}: choose from {FRONT_ENDS}")
    worker_hosts = list(range(cluster.hosts)) if worker_hosts is None else list(worker_hosts)
    shard_hosts = list(worker_hosts) if shard_hosts is None else list(shard_hosts)
    hook = front_end == "ddp-hook"
    name = f"{'ddp-cgx' if hook else 'cgx'}/{model}/{compression}"
    port = next(_port_counter)
    with start_shards(cluster, shard_hosts, extra_args=shard_args) as shards:
        job_id = f"{name}-{uuid.uuid4().hex[:8]}"

        def env(i: int) -> dict[str, str]:
            rank = worker_hosts.index(i)
            # the shards on this worker's host: the worker adds their CPU to its host's per step
            colocated = ",".join(str(p.pid) for h, p in zip(shards.hosts, shards.procs) if h == i)
            return _repo_env({"RANK": rank, "WORLD_SIZE": len(worker_hosts), "CGX_PS_NODE_RANK": rank,
                              "CGX_PS_NUM_NODES": len(worker_hosts), "CGX_PS_SERVERS": shards.servers,
                              "CGX_PS_TOKEN_FILE": shards.token_file, HOST_PIDS_ENV: colocated,
                              "CGX_PS_JOB_ID": job_id, **_thread_env(threads),
                              # DDP's own gloo group (for the broadcast at wrap time and barriers)
                              **({"MASTER_ADDR": cluster.address(worker_hosts[0]), "MASTER_PORT": port,
                                  "GLOO_SOCKET_IFNAME": HOST_IFACE} if hook else {})})

        if hook:
            argv = _ddp_argv(model, "cgx", steps, warmup, batch_size, threads, seed, timeout,
                             ["--compression", compression, *extra_args])
        else:
            argv = _cgx_argv(model, compression, steps, warmup, batch_size, threads, seed, extra_args)
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


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _ddp_table(cluster: Cluster, args: argparse.Namespace) -> list[dict]:
    rows = []
    kw = dict(model=args.model, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
              threads=args.threads, seed=args.seed, timeout=args.timeout)
    single = run_single_process(cluster, **kw)
    r0 = single.results[0] if single.ok else None
    rows.append({"config": "single-process", "status": single.status,
                 "median_step_s": r0 and r0["single_process_compute_s"], "eval_loss": r0 and r0["eval_loss"],
                 "tx_mb_per_step": None, "bucket_cap_mb": None, "wall_s": single.wall_s,
                 "per_rank": single.results})
    print(f"  single-process: {single.status} ({single.wall_s:.1f}s)", file=sys.stderr, flush=True)
    extra = [] if args.bucket_cap_mb is None else ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    for hook in args.hooks:
        res = run_ddp(cluster, hook=hook, extra_args=extra, **kw)
        print(f"  ddp/{hook}: {res.status} ({res.wall_s:.1f}s)", file=sys.stderr, flush=True)
        if not res.ok and not res.timed_out:
            for i, tail in enumerate(res.stderr_tails):
                if tail.strip():
                    print(f"    host {i} stderr: ...{tail[-600:]}", file=sys.stderr)
        ok = [r for r in res.results if r]
        med = max(r["median_step_s"] for r in ok) if res.ok else None  # the slowest rank sets the pace
        tx = [r["tx_bytes_per_step"] for r in ok if r.get("tx_bytes_per_step") is not None]
        rows.append({"config": f"ddp gloo hook={hook}", "status": res.status, "median_step_s": med,
                     "eval_loss": ok[0]["eval_loss"] if res.ok else None,
                     "bucket_cap_mb": ok[0].get("bucket_cap_mb") if ok else None,
                     "per_rank": res.results,
                     "tx_mb_per_step": (statistics.mean(tx) / 1e6) if res.ok and tx else None,
                     "wall_s": res.wall_s})
    return rows


def _print_table(rows: list[dict], header: str) -> None:
    print(header)
    print(f"{'config':<24} {'median s/step':>13} {'tx MB/step/host':>15} {'eval loss':>9} {'bucket MiB':>10}  status")
    for r in rows:
        print(f"{r['config']:<24} {_fmt(r['median_step_s']):>13} {_fmt(r['tx_mb_per_step'], '.2f'):>15} "
              f"{_fmt(r['eval_loss'], '.4f'):>9} {_fmt(r.get('bucket_cap_mb'), 'g'):>10}  {r['status']}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="per-link rate, both directions (tc units; default 1gbit)")
    p.add_argument("--burst-ms", type=float, default=ClusterConfig.burst_ms)
    p.add_argument("--latency-ms", type=float, default=ClusterConfig.latency_ms)
    p.add_argument("--cleanup", action="store_true", help="remove cgxb- leftovers of earlier runs and exit")
    p.add_argument("--measure", action="store_true", help="measure host0 -> host1 TCP throughput")
    p.add_argument("--seconds", type=float, default=2.0, help="duration of --measure")
    p.add_argument("--ddp", action="store_true", help="run ddp_step.py per hook and print a table")
    p.add_argument("--model", default="mlp17m")
    p.add_argument("--hooks", nargs="+", default=["none", "fp16", "powersgd"], choices=["none", "fp16", "powersgd"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP bucket size for every hook (default: ddp_step.py's choice per hook)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per configuration")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--_sink", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--_source", nargs=3, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args._sink:  # internal: the receiving end of measure_link (runs inside a host)
        _sink_main(args._sink[0], int(args._sink[1]))
        return 0
    if args._source:
        _source_main(args._source[0], int(args._source[1]), float(args._source[2]))
        return 0
    try:
        _require_root()
    except NotRootError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cleanup:
        found = cleanup_leftovers(verbose=True)
        if not (found["netns"] or found["links"]):
            print("no cgxb- leftovers")
        return 0
    if not (args.measure or args.ddp):
        print("nothing to do: pass --measure and/or --ddp (or --cleanup)", file=sys.stderr)
        return 2
    report: dict = {"hosts": args.hosts, "rate": args.rate}
    try:
        with Cluster(config=ClusterConfig(hosts=args.hosts, rate=args.rate, burst_ms=args.burst_ms,
                                          latency_ms=args.latency_ms)) as c:
            if args.measure:
                gbps = measure_link(c, seconds=args.seconds)
                report["link_gbit_s"] = gbps
                print(f"link host0 -> host1 at {args.rate}: {gbps:.3f} Gbit/s")
            if args.ddp:
                rows = _ddp_table(c, args)
                report["ddp"] = rows
                _print_table(rows, f"{args.model}, batch {args.batch_size}, {args.threads} thread(s)/worker, "
                                   f"{args.hosts} hosts at {args.rate}, {args.steps} steps ({args.warmup} warm-up)")
    except LeftoversError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted; cluster removed", file=sys.stderr)
        return 130
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
