"""Link measurement: the TCP goodput of one stream between two emulated hosts.

``measure_link(cluster)`` runs this module on two hosts: ``sink`` accepts one connection and
reads until EOF, ``source`` sends for a given time. The receiver times from its first read to
EOF, so connection setup and slow start before the first byte are left out. The roles are
internal (``python -m benchmarks.linkprobe sink HOST PORT``; ``source HOST PORT SECONDS``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python benchmarks/linkprobe.py`: import the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.emulator import Cluster  # noqa: E402
from benchmarks.netns import ClusterError, kill_pids  # noqa: E402

__all__ = ["measure_link"]

REPO_ROOT = Path(__file__).resolve().parents[1]  # the probe's roles run as `python -m benchmarks.linkprobe`

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
    probe = [sys.executable, "-m", __name__]
    sink = cluster.spawn(dst, [*probe, "sink", cluster.address(dst), str(port)], cwd=REPO_ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if sink.stdout.readline().strip() != "ready":
            raise ClusterError(f"link sink failed: {sink.stderr.read()}")
        source = cluster.spawn(src, [*probe, "source", cluster.address(dst), str(port), str(seconds)],
                               cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
        _, err = source.communicate(timeout=seconds + 30)
        if source.returncode != 0:
            raise ClusterError(f"link source failed: {err}")
        out, err = sink.communicate(timeout=30)
        if sink.returncode != 0:
            raise ClusterError(f"link sink failed: {err}")
    finally:
        for p in (sink,):
            if p.poll() is None:
                kill_pids([p.pid])
    r = json.loads(out.strip().splitlines()[-1])
    return r["bytes"] * 8 / r["seconds"] / 1e9


def main(argv: list[str]) -> int:
    """The probe's two roles, started by ``measure_link`` inside the hosts."""
    if len(argv) == 3 and argv[0] == "sink":
        _sink_main(argv[1], int(argv[2]))
        return 0
    if len(argv) == 4 and argv[0] == "source":
        _source_main(argv[1], int(argv[2]), float(argv[3]))
        return 0
    print("usage: python -m benchmarks.linkprobe sink HOST PORT | source HOST PORT SECONDS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
