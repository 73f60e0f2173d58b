"""What many tests share: the job token their shards require, clients that carry it, and stopping a process."""

from __future__ import annotations

import atexit
import shutil
import signal
import subprocess
import tempfile

from cgx_ps.security import ChannelSecurity, new_token_file

_dir = tempfile.mkdtemp(prefix="cgx-ps-test-token-")
atexit.register(shutil.rmtree, _dir, True)

TOKEN_FILE = new_token_file(_dir)  # one job token for the test session's shards and clients
SECURITY = ChannelSecurity(token_file=TOKEN_FILE)
METADATA = SECURITY.metadata()  # authorization: Bearer <token>, for raw stub calls


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
