"""One shard process on loopback, started for a memory measurement, and what /proc says of its
memory once it has settled (``shard_memory.py``, ``shard_attack.py``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cgx_ps.server.cluster import STARTUP_TIMEOUT_S, launch_shard, wait_for_port_file

__all__ = ["MiB", "Shard", "run", "settle", "shown", "start_shard", "status"]

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
_LOOP: asyncio.AbstractEventLoop | None = None


def run(coro):
    """Run on one event loop for the whole script: grpc.aio binds its completion queue to the
    first loop, and after a second asyncio.run it reports into a closed one."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        asyncio.set_event_loop(_LOOP)
    return _LOOP.run_until_complete(coro)


# ---- the shard process and /proc --------------------------------------------------------------------

def status(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile of a process, MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) / 1024
    return out


def settle(pid: int, quiet_s: float = 1.5, timeout_s: float = 60.0) -> dict[str, float]:
    """/proc status once VmRSS has stopped moving (< 1 MiB over ``quiet_s``)."""
    deadline = time.monotonic() + timeout_s
    last = status(pid)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = status(pid)
        if abs(now["VmRSS"] - last["VmRSS"]) < 1.0:
            return now
        last = now
    return last


@dataclass
class Shard:
    proc: subprocess.Popen
    address: str
    cmd: list[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_shard(tmp: str, token: str, inflight_mb: int, error_feedback: bool = False,
                extra: tuple[str, ...] = ()) -> Shard:
    port_file = Path(tmp) / f"port-{time.monotonic_ns()}.json"
    flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--token-file", token,
             "--max-inflight-mb", str(inflight_mb), "--kernel-threads", "1", "--log-level", "ERROR",
             *(["--error-feedback"] if error_feedback else []), *extra]
    # gRPC streams, as when this was measured (the data plane is a shard's default now)
    proc = launch_shard(flags, port_file, cwd=ROOT, env={**os.environ, "CGX_PS_DATA_PORT": "-1"})
    try:
        port = wait_for_port_file(proc, port_file, time.monotonic() + STARTUP_TIMEOUT_S)["port"]
    except (RuntimeError, TimeoutError) as exc:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"shard did not start ({exc}): {' '.join(proc.args)}") from None
    return Shard(proc, f"127.0.0.1:{port}", list(proc.args))


def shown(cmd: list[str]) -> str:
    """The command as one would type it (temp paths shortened)."""
    out = ["python"] + cmd[1:]
    return " ".join("F" if a.endswith(".json") else "T" if a.endswith("/token") else a for a in out)

