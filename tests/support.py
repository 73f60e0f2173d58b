"""What many tests share: the job token their shards require, clients that carry it, and stopping a process."""

from __future__ import annotations

import atexit
import shutil
import signal
import subprocess
import tempfile

from cgx_ps.security import ChannelSecurity, new_token_file
from cgx_ps.worker.client import ShardClient

_dir = tempfile.mkdtemp(prefix="cgx-ps-test-token-")
atexit.register(shutil.rmtree, _dir, True)

TOKEN_FILE = new_token_file(_dir)  # one job token for the test session's shards and clients
SECURITY = ChannelSecurity(token_file=TOKEN_FILE)
METADATA = SECURITY.metadata()  # authorization: Bearer <token>, for raw stub calls


async def connect(server, layout, nodes: int, prefix: str = "node") -> list[ShardClient]:
    """``nodes`` clients of the in-process shard ``server`` (nodes ``{prefix}-0`` ...), connected,
    carrying the job token."""
    clients = [ShardClient(f"127.0.0.1:{server.port}", f"{prefix}-{i}", nodes, layout, connect_timeout_s=5,
                           security=SECURITY)
               for i in range(nodes)]
    for c in clients:
        await c.connect()
    return clients


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
