"""Several local shard processes: ``cgx-ps cluster``, the demo and the tests use this."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..net.addresses import host_port
from ..net.security import new_token_file
from .config import shard_flags

__all__ = ["LocalCluster", "launch_shard", "run_cluster", "shard_port", "wait_for_port_file"]


# A shard compiles its kernels before it serves: ~70 s on 2 cores the first time after an install
# (numba caches them next to the package; later starts take ~1 s), so the first `cgx-ps demo` or
# `cgx-ps cluster` after `pip install` needs this much patience.
STARTUP_TIMEOUT_S = 240.0


def shard_port(base: int | None, i: int) -> int | None:
    """Shard ``i``'s port from a cluster's base port: base + i; 0 (a free port each), -1 (off) and
    None (the shard's own default) as they are."""
    return base + i if base is not None and base > 0 else base


class LocalCluster:
    """Start N ``cgx-ps server`` processes and wait until each serves; stop them with SIGTERM.

    With base_port 0 every shard picks a free port, reported back through a port file. The
    shards require a job token: ``token_file``, else the one CGX_PS_TOKEN_FILE names, else a
    fresh random one (secure by default);
    ``worker_env()`` is what workers need to reach them. ``token_file=""`` runs without one.
    """

    def __init__(self, shards: int, host: str = "127.0.0.1", base_port: int = 0,
                 metrics_base_port: int = -1, extra_args: list[str] | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S, log_dir: str | None = None,
                 token_file: str | None = None, data_base_port: int | None = -1, health_base_port: int = -1
                 ) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        self.shards, self.host, self.base_port = shards, host, base_port
        self.metrics_base_port = metrics_base_port
        self.data_base_port = data_base_port
        self.health_base_port = health_base_port
        self.extra_args = extra_args or []
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []
        self.metrics_ports: list[int] = []
        self.data_ports: list[int] = []  # the raw data planes', else -1
        self.health_ports: list[int] = []  # the plaintext health ports, else -1
        self._tmp = tempfile.TemporaryDirectory(prefix="cgx-ps-cluster-")
        if token_file is None:  # the job's token, if the environment names one, else a fresh one
            token_file = os.environ.get("CGX_PS_TOKEN_FILE") or new_token_file(self._tmp.name)
        self.token_file = token_file

    @property
    def addresses(self) -> list[str]:
        return [host_port(self.host, p) for p in self.ports]

    def worker_env(self) -> dict[str, str]:
        """The environment workers need to reach these shards."""
        env = {"CGX_PS_SERVERS": ",".join(self.addresses)}
        if self.token_file:
            env["CGX_PS_TOKEN_FILE"] = self.token_file
        return env

    def start(self, abort: Callable[[], bool] = lambda: False) -> "LocalCluster":
        """Start every shard and wait until each serves; ``abort()`` true (polled) stops them all
        and raises RuntimeError."""
        files = []
        for i in range(self.shards):
            proc, port_file = self._spawn(i, shard_port(self.base_port, i), shard_port(self.metrics_base_port, i),
                                          shard_port(self.data_base_port, i), shard_port(self.health_base_port, i))
            self.procs.append(proc)
            files.append(port_file)
        deadline = time.monotonic() + self.startup_timeout_s
        for i, (proc, port_file) in enumerate(zip(self.procs, files)):
            try:
                info = wait_for_port_file(proc, port_file, deadline, abort)
            except (RuntimeError, TimeoutError) as exc:
                self.stop()
                raise type(exc)(f"shard {i} {exc}") from None
            self.ports.append(info["port"])
            self.metrics_ports.append(info["metrics_port"])
            self.data_ports.append(info.get("data_port", -1))
            self.health_ports.append(info.get("health_port", -1))
        return self

    def _spawn(self, i: int, port: int, metrics_port: int, data_port: int | None, health_port: int
               ) -> tuple[subprocess.Popen, Path]:
        port_file = Path(self._tmp.name) / f"shard{i}.json"
        port_file.unlink(missing_ok=True)
        # every per-shard port on the command line: a CGX_PS_DATA_PORT or CGX_PS_HEALTH_PORT in
        # the environment would otherwise give every shard the same one (extra_args still win);
        # data_port None: the shard's default (no raw data plane, unless CGX_PS_DATA_PORT... is dropped here),
        # without a CGX_PS_DATA_PORT of the environment, which names one port for all of them
        data = ["--data-port", str(data_port)] if data_port is not None else []
        env = {k: v for k, v in os.environ.items() if k != "CGX_PS_DATA_PORT"} if data_port is None else None
        flags = ["--host", self.host, "--port", str(port), "--shard-index", str(i),
                 "--num-shards", str(self.shards), "--metrics-port", str(metrics_port), *data,
                 "--health-port", str(health_port), "--token-file", self.token_file or "", *self.extra_args]
        out = open(Path(self.log_dir) / f"shard{i}.log", "a") if self.log_dir else None  # a restart appends
        return launch_shard(flags, port_file, stdout=out, stderr=subprocess.STDOUT if out else None, env=env), port_file

    def restart(self, i: int) -> None:
        """Start shard ``i`` again on its port (as a StatefulSet restarts a pod on its address),
        after it died or was killed; wait until it serves. Its old process must be gone."""
        if self.procs[i].poll() is None:
            raise RuntimeError(f"shard {i} (pid {self.procs[i].pid}) is still running")
        mport = self.metrics_ports[i] if self.metrics_base_port >= 0 else -1
        hport = self.health_ports[i] if self.health_base_port >= 0 else -1
        # the data port as at the start: base + i again, or (0) another free one
        proc, port_file = self._spawn(i, self.ports[i], mport, shard_port(self.data_base_port, i), hport)
        self.procs[i] = proc
        try:
            info = wait_for_port_file(proc, port_file, time.monotonic() + self.startup_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"shard {i} restarted on port {self.ports[i]} {exc}") from None
        self.data_ports[i] = info.get("data_port", -1)  # --data-port 0: another free port

    def signal_running(self, signum: int) -> None:
        """``signum`` to every shard still running."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def stop(self, timeout_s: float = 30.0) -> list[int]:
        """SIGTERM every shard (they drain), wait, SIGKILL stragglers; return exit codes. The
        generated token file goes with the cluster."""
        self.signal_running(signal.SIGTERM)
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        self._tmp.cleanup()
        return codes

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_shard(flags: Sequence[str], port_file: Path, spawn: Callable[..., subprocess.Popen] = subprocess.Popen,
                 **popen_kwargs: Any) -> subprocess.Popen:
    """Start ``cgx-ps server FLAGS --port-file PORT_FILE`` (``spawn(argv, **popen_kwargs)``: a
    Popen, or one in a network namespace); ``wait_for_port_file`` then says when it serves.

    The shard starts with SIGINT blocked and unblocks it once its handler is in place (before it
    writes the port file): a terminal's Ctrl-C reaches the whole process group, and a shard still
    starting up would die of it with a KeyboardInterrupt traceback from wherever its imports were.
    The launcher, which gets the Ctrl-C too, stops such a shard with SIGTERM. (Blocked, because a
    signal mask passes through exec; not a ``preexec_fn``: with gRPC channels open in this
    process, gRPC's fork handlers crash a child forked that way, grpc/grpc#43055.)"""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # this thread only, for the spawn
    try:
        return spawn([sys.executable, "-m", "cgx_ps.cli", "server", *flags, "--port-file", str(port_file)],
                     **popen_kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def wait_for_port_file(proc: subprocess.Popen, port_file: Path, deadline: float,
                       abort: Callable[[], bool] = lambda: False) -> dict:
    """The ports a ``cgx-ps server --port-file`` process reports once it serves (the file is
    written whole, by rename); RuntimeError if it exits or ``abort()``, TimeoutError past
    ``deadline`` (time.monotonic())."""
    while not port_file.exists():
        if abort():
            raise RuntimeError("start-up interrupted")
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} during startup")
        if time.monotonic() > deadline:
            raise TimeoutError("did not start in time")
        time.sleep(0.05)
    return json.loads(port_file.read_text())


def run_cluster(args: argparse.Namespace) -> int:
    """``cgx-ps cluster``: start ``--shards`` local shard processes, print the workers'
    environment, and keep them running until Ctrl-C or SIGTERM (then they drain and stop).

    Args:
        args: the parsed flags of ``cgx-ps cluster`` (the shards' own flags, passed on to each).

    Returns:
        The exit status: 0 when every shard stopped cleanly, 1 when one failed to start or
        exited on its own (the others are stopped), 130 after Ctrl-C during start-up.
    """
    # Every shard gets the cluster's settings; LocalCluster sets the per-shard ones and the token
    # (no --token-file: a fresh random one, written where only this user can read it).
    extra = shard_flags(vars(args), skip=("token_file",))
    cluster = LocalCluster(args.shards, args.host, args.base_port, args.metrics_base_port, extra,
                           token_file=args.token_file or None, data_base_port=args.data_base_port,
                           health_base_port=args.health_base_port)
    received: list[int] = []  # signals that ask us to stop

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start(abort=lambda: bool(received))
    except (RuntimeError, TimeoutError) as exc:  # the shard printed its own reason above
        if received:  # Ctrl-C during start-up: the shards got it too
            return 130
        print(f"cgx-ps cluster: {exc} (its reason is above; shard i uses base + i of "
              f"{_bases(args)}); stopped the others", file=sys.stderr)
        return 1
    exports = " ".join(f"{k}={v}" for k, v in cluster.worker_env().items())
    print(f"cgx-ps cluster: {args.shards} shards serving; for the workers: export {exports}\n"
          f"cgx-ps cluster: then `cgx-ps status` shows them, one line each; Ctrl-C stops them", flush=True)
    try:
        while not received:
            dead = [i for i, p in enumerate(cluster.procs) if p.poll() is not None]
            if dead and not received:
                print(f"cgx-ps cluster: shard(s) {dead} exited; stopping the rest", file=sys.stderr)
                cluster.stop()
                return 1
            time.sleep(0.2)
    finally:
        if received[:1] == [signal.SIGINT]:
            # A terminal's Ctrl-C reached the shards too (the whole process group); a SIGINT sent
            # to this process alone (kill -INT) reached none: passed on, it reaches every shard,
            # and one that had it already ignores the second (server/main.py). They drain; a
            # second signal to us (Ctrl-C again, SIGTERM) stops waiting and stops them now.
            if any(p.poll() is None for p in cluster.procs):
                # said before the shards are told: their 'stopped' lines come after it
                print("cgx-ps cluster: stopping the shards; they finish the rounds in flight first "
                      "(Ctrl-C again to stop them now)", file=sys.stderr, flush=True)
                cluster.signal_running(signal.SIGINT)
            deadline = time.monotonic() + args.drain_timeout + 5
            while any(p.poll() is None for p in cluster.procs) and time.monotonic() < deadline \
                    and len(received) < 2:
                time.sleep(0.05)
        codes = cluster.stop()  # SIGTERM to those still running (all of them after a SIGTERM to us)
    if 130 in codes:
        return 130  # Ctrl-C while they were starting
    return 0 if all(c == 0 for c in codes) else 1


def _bases(args: argparse.Namespace) -> str:
    """The base ports shard i adds i to, as the flags that set them ("--base-port 7070, ...")."""
    bases = [("--base-port", args.base_port), ("--metrics-base-port", args.metrics_base_port),
             ("--data-base-port", args.data_base_port), ("--health-base-port", args.health_base_port)]
    return ", ".join(f"{flag} {base}" for flag, base in bases if base is not None and base > 0)


if __name__ == "__main__":  # pragma: no cover
    os.execvp(sys.executable, [sys.executable, "-m", "cgx_ps.cli", "cluster", *sys.argv[1:]])
