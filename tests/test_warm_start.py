"""The tests' warm-started worker processes (tests/workers/warm_start.py) behave as the
``subprocess.Popen`` of a fresh interpreter would: argv, environment, working directory, pipes,
exit codes, timeouts and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.warm_start import run_worker, start_worker

WORKER = Path(__file__).resolve().parent / "workers/quorum_worker.py"


def unreachable_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, RANK="0", WORLD_SIZE="1", CGX_PS_SERVERS="127.0.0.1:9", **extra)


def test_a_warm_worker_takes_its_argv_environment_and_directory_and_exits_with_its_code(tmp_path):
    usage = run_worker([sys.executable, str(WORKER), "--help"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: quorum_worker.py"), usage
    bad = run_worker([sys.executable, str(WORKER), "--steps", "many"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid int value: 'many'" in bad.stderr, bad
    # the environment is the child's: its shard address and connect timeout, in a traceback on stderr
    failed = run_worker([sys.executable, str(WORKER), "--out", str(tmp_path / "x.pt")], capture_output=True, text=True,
                        timeout=120, env=unreachable_env(CGX_PS_CONNECT_TIMEOUT="1"))
    assert failed.returncode == 1, failed
    assert "ShardUnavailableError: shard 127.0.0.1:9 unreachable for 1s" in failed.stderr, failed.stderr[-2000:]
    assert not (tmp_path / "x.pt").exists()


def test_a_warm_worker_can_be_waited_on_with_a_timeout_stopped_and_killed():
    proc = start_worker([sys.executable, str(WORKER), "--out", os.devnull], stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE, text=True, env=unreachable_env(CGX_PS_CONNECT_TIMEOUT="600"))
    try:
        assert type(proc) is not subprocess.Popen  # forked by the zygote, not started fresh
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1)
        assert proc.poll() is None
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/stat").read_text().split()[2] != "T":
            assert time.monotonic() < deadline, "SIGSTOP did not stop the child"
            time.sleep(0.01)
        assert proc.poll() is None  # stopped is not exited
        proc.kill()
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert proc.poll() == -signal.SIGKILL
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def test_warm_start_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("CGX_PS_TEST_WARM_START", "0")
    proc = start_worker([sys.executable, str(WORKER), "--help"], stdout=subprocess.PIPE, text=True)
    assert type(proc) is subprocess.Popen
    assert proc.communicate(timeout=120)[0].startswith("usage:") and proc.returncode == 0
