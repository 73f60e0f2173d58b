"""What many tests share: the job token their shards require, clients that carry it, a worker's
environment, shards for either data plane, starting a process Ctrl-C can stop and stopping one, and
waiting for what happens in the background."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from cgx_ps.net.security import ChannelSecurity, new_token_file
from cgx_ps.worker.shards.client import ShardClient

_dir = tempfile.mkdtemp(prefix="cgx-ps-test-token-")
atexit.register(shutil.rmtree, _dir, True)

TOKEN_FILE = new_token_file(_dir)  # one job token for the test session's shards and clients
SECURITY = ChannelSecurity(token_file=TOKEN_FILE)
METADATA = SECURITY.metadata()  # authorization: Bearer <token>, for raw stub calls


def free_port() -> int:
    """A TCP port free on the loopback now (for a server that cannot bind port 0 itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(rank: int, world: int, servers: list[str], **extra: str) -> dict[str, str]:
    """The environment of worker process ``rank`` of ``world``, alone on its node (one rank per
    node), against the shards at ``servers``; ``extra`` added last."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               CGX_PS_NODE_RANK=str(rank), CGX_PS_NUM_NODES=str(world), CGX_PS_SERVERS=",".join(servers),
               OMP_NUM_THREADS="1", CGX_PS_CONNECT_TIMEOUT="20")
    env.update(extra)
    return env


# The ways a worker's Exchange streams reach the shards (conftest's ``plane`` fixture): the gRPC
# port, the shards' default, or the opt-in raw data plane (--data-port).
PLANES = ("grpc", "raw")


def plane_env(plane: str) -> dict[str, str]:
    """A worker's environment for ``plane``: CGX_PS_DATAPLANE, so that on "raw" it must take the
    data plane (it fails if a shard advertises none) and on "grpc" it never tries one."""
    return {"CGX_PS_DATAPLANE": plane}


def plane_settings(plane: str) -> dict[str, int]:
    """LocalCluster's settings for shards that serve ``plane``: on "grpc" as started by default (no
    data port), on "raw" with the raw data plane on a free port each, as ``--data-port 0`` opens it."""
    return {"data_base_port": 0 if plane == "raw" else -1}


async def connect(server, layout, nodes: int, prefix: str = "node") -> list[ShardClient]:
    """``nodes`` clients of the in-process shard ``server`` (nodes ``{prefix}-0`` ...), connected,
    carrying the job token."""
    clients = [ShardClient(f"127.0.0.1:{server.port}", f"{prefix}-{i}", nodes, layout, connect_timeout_s=5,
                           security=SECURITY)
               for i in range(nodes)]
    for c in clients:
        await c.connect()
    # connect() sends each stream's Hello without waiting for the shard to take it: wait until it
    # has, so a stream a test then opens by hand as one of these nodes is the newer one (Hellos
    # on different connections can arrive in either order, and the later one replaces the other)
    deadline = time.monotonic() + 10
    while any((c.node_id, c.member) not in server.service.session.streams for c in clients):
        assert time.monotonic() < deadline, "the shard did not take the clients' streams within 10 s"
        await asyncio.sleep(0.005)
    return clients


def interruptible(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, ...)`` with SIGINT at its default disposition in the child, as a
    terminal's foreground command has it, for tests that stop a process with Ctrl-C. A test run
    started in the background (``pytest ... &`` in a script) has SIGINT ignored, and a child
    inherits that through exec: it would never see the test's Ctrl-C. Not through a
    ``preexec_fn``: that forks with this process's gRPC threads running, which can crash the
    child in gRPC's fork handlers (grpc/grpc#43055; cluster.launch_shard avoids it too)."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:  # an ignored disposition passes through exec; a Python handler becomes SIG_DFL
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        return subprocess.Popen(args, **popen_kwargs)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def terminate(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``proc`` and wait up to ``timeout`` s for it to tear down; SIGKILL it if it is
    still there then (or if the test failed before the SIGTERM), so no test leaves it behind."""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait until ``condition()`` holds: what a shard or a client does in the background (a
    timer, a repair, a push arriving) takes its time on a loaded machine, so a test waits for it
    rather than sleeping a fixed time. Fails the test, saying ``what`` did not happen, if it does
    not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g}s"
        await asyncio.sleep(0.01)


def wait_until_stopped(pid: int, timeout: float) -> None:
    """Until the process has stopped itself (SIGSTOP: state T in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        time.sleep(0.05)
    raise TimeoutError(f"process {pid} did not stop")
