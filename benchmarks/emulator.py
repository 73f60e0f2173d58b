"""A commodity-cluster emulator on one Linux machine: H network namespaces on one shaped bridge.

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
A cluster refuses to start over leftovers of an earlier run (``benchmarks.netns``).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import threading
import weakref
from dataclasses import dataclass
from typing import Mapping, Sequence

from benchmarks.netns import (BRIDGE, HOST_IFACE, PREFIX, SUBNET, SWITCH_NS, ClusterError, LeftoversError,
                              cleanup_command, find_leftovers, kill_pids, netns_pids, require_root, run_cmd)

__all__ = ["Cluster", "ClusterConfig", "parse_rate", "tbf_params"]



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


@dataclass(frozen=True)
class ClusterConfig:
    hosts: int = 2
    rate: str = "1gbit"        # per host link, each direction (tc units)
    burst_ms: float = 2.0      # token bucket depth, in ms of line rate (>= 128 KiB)
    latency_ms: float = 5.0    # queue depth beyond the bucket, in ms of line rate
    # a host's own uplink queue, if not latency_ms: a real host's NIC queue (pfifo_fast's 1000
    # packets, fq's 10000) is far deeper than a switch port's, and drops there cost TCP a retransmit
    host_queue_ms: float | None = None
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
        require_root()
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
        host_queue_ms = cfg.latency_ms if cfg.host_queue_ms is None else cfg.host_queue_ms
        host_tbf = ["tbf", "rate", cfg.rate, "burst", str(burst),
                    "limit", str(tbf_params(cfg.rate_bps, cfg.burst_ms, host_queue_ms)[1])]
        run_cmd("ip", "netns", "add", SWITCH_NS)
        run_cmd("ip", "-n", SWITCH_NS, "link", "set", "lo", "up")
        run_cmd("ip", "-n", SWITCH_NS, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        run_cmd("ip", "-n", SWITCH_NS, "link", "set", BRIDGE, "up")
        for i in range(cfg.hosts):
            ns, port = self.netns(i), self.switch_port(i)
            run_cmd("ip", "netns", "add", ns)
            if cfg.disable_ipv6:
                run_cmd("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                     "net.ipv6.conf.default.disable_ipv6=1")
            # both ends are created directly inside their namespaces
            run_cmd("ip", "link", "add", HOST_IFACE, "netns", ns, "mtu", str(cfg.mtu), "type", "veth",
                 "peer", "name", port, "netns", SWITCH_NS, "mtu", str(cfg.mtu))
            run_cmd("ip", "-n", SWITCH_NS, "link", "set", port, "master", BRIDGE)
            run_cmd("ip", "-n", SWITCH_NS, "link", "set", port, "up")
            run_cmd("ip", "-n", ns, "link", "set", "lo", "up")
            run_cmd("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", HOST_IFACE)
            run_cmd("ip", "-n", ns, "link", "set", HOST_IFACE, "up")
            run_cmd("tc", "-n", ns, "qdisc", "replace", "dev", HOST_IFACE, "root", *host_tbf)  # host -> switch
            run_cmd("tc", "-n", SWITCH_NS, "qdisc", "replace", "dev", port, "root", *tbf)  # switch -> host

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
            kill_pids([p.pid for p in self.procs if p.poll() is None])
            for p in self.procs:
                try:
                    p.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
            names = [self.netns(i) for i in range(self.hosts)] + [SWITCH_NS]
            for ns in names:  # anything else still running inside (grandchildren)
                kill_pids(netns_pids(ns))
            for ns in names:
                run_cmd("ip", "netns", "delete", ns, check=False)
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
        p = run_cmd("ip", "netns", "exec", self.netns(i), "cat", f"/sys/class/net/{HOST_IFACE}/statistics/tx_bytes")
        return int(p.stdout)
