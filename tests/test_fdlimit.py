"""The shard's open-file limit (server/process/fdlimit.py): raised at start to what the caps need, or a
warning when even the hard limit is below it (the shard then runs at the hard limit). The decision as a table; real `cgx-ps server`
processes started under low limits (set by a wrapper that execs the CLI: no preexec_fn), one
refused and one that then holds more connections than its inherited soft limit allowed."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cgx_ps.net.raw_frames import HEADER, frame_header, parse_status, split_header
from cgx_ps.server.cluster import launch_shard, wait_for_port_file
from cgx_ps.server.config import ServerConfig
from cgx_ps.server.process.fdlimit import RESERVED_FDS, FdAction, decide_fd_limit, fds_needed
from support import TOKEN_FILE

INF = resource.RLIM_INFINITY
# Sets RLIMIT_NOFILE to (argv[1], argv[2]), then execs the rest: the limits pass through exec.
_WITH_LIMITS = "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), " \
               "int(sys.argv[2]))); os.execv(sys.executable, [sys.executable, *sys.argv[3:]])"


def _config(rpcs: int, data_port: int = -1, health_port: int = -1) -> ServerConfig:
    return ServerConfig(port=0, max_concurrent_rpcs=rpcs, data_port=data_port, health_port=health_port)


@pytest.mark.parametrize("config, soft, hard, action, new_soft", [
    # the gRPC port's calls only: 64 + 1024
    (_config(1024), 1024, 1 << 20, FdAction.RAISE, 64 + 1024),
    (_config(1024), 4096, 4096, FdAction.KEEP, 4096),
    (_config(1024), INF, INF, FdAction.KEEP, INF),
    (_config(1024), 1024, INF, FdAction.RAISE, 64 + 1024),
    # with the data plane: its streams and as many pending connections again, 64 + 3 x 128
    (_config(128, data_port=7072), 256, 448, FdAction.RAISE, 448),
    (_config(128, data_port=7072), 448, 448, FdAction.KEEP, 448),
    (_config(128, data_port=7072), 256, 447, FdAction.SHORT, 447),
    # the tls component's health-only port: 16 calls more
    (_config(128, health_port=7071), 100, 1000, FdAction.RAISE, 64 + 128 + 16),
    (_config(1024), 1024, 1024, FdAction.SHORT, 1024),  # a plain `cgx-ps server` under 1024:1024 runs
])
def test_the_limit_follows_the_caps(config, soft, hard, action, new_soft) -> None:
    decision = decide_fd_limit(config, soft, hard)
    assert (decision.action, decision.soft, decision.needed) == (action, new_soft, fds_needed(config))
    assert bool(decision.problem) == (action is FdAction.SHORT)


def test_the_warning_names_the_numbers_and_what_to_change() -> None:
    problem = decide_fd_limit(_config(1024, data_port=0), 1024, 2048).problem
    needed = RESERVED_FDS + 3 * 1024
    assert f"--max-concurrent-rpcs 1024 needs up to {needed} file descriptors" in problem
    assert "hard limit (ulimit -Hn) is 2048" in problem and "--data-port" in problem
    assert f"lower --max-concurrent-rpcs to {(2048 - RESERVED_FDS) // 3} or less" in problem
    # a cap that cannot go low enough is not offered
    assert "lower" not in decide_fd_limit(_config(8, data_port=0), 16, 40).problem


def _shard(tmp_path: Path, soft: int, hard: int, *flags: str) -> tuple[subprocess.Popen, Path]:
    """`cgx-ps server` on port 0 with a token, under the open-file limits (soft, hard)."""
    port_file = tmp_path / f"ports-{time.monotonic_ns()}.json"
    flags = ("--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--token-file", TOKEN_FILE,
             "--kernel-threads", "1", *flags)
    # launch_shard's argv is [python, -m, cgx_ps.cli, server, ...]: the wrapper execs that under the limits
    proc = launch_shard(flags, port_file, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        spawn=lambda argv, **kw: subprocess.Popen(
                            [argv[0], "-c", _WITH_LIMITS, str(soft), str(hard), *argv[1:]], **kw))
    return proc, port_file


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc (Linux)")
def test_a_shard_whose_hard_limit_is_too_low_runs_at_it_and_warns_once(tmp_path: Path) -> None:
    proc, port_file = _shard(tmp_path, 256, 300, "--max-concurrent-rpcs", "128", "--data-port", "0")
    try:
        try:
            wait_for_port_file(proc, port_file, time.monotonic() + 120)
        except (RuntimeError, TimeoutError) as exc:
            proc.kill()
            raise AssertionError(f"shard {exc}: {proc.communicate()[0]}") from None
        assert _limits(proc.pid) == (300, 300)  # as far as the hard limit allows
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    warnings = [line for line in out.splitlines() if "open-file limit is too low" in line]
    assert len(warnings) == 1 and "level=WARNING" in warnings[0], out
    assert "--max-concurrent-rpcs 128 needs up to 448 file descriptors" in warnings[0], out
    assert "the shard runs with 300" in warnings[0] and "Traceback" not in out, out


def _limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc")


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc (Linux)")
def test_a_shard_raises_its_soft_limit_and_holds_more_connections_than_it_allowed(tmp_path: Path) -> None:
    """Started with a soft limit of 128, the shard holds 120 connections on its data plane beside
    its own descriptors, and answers the last one: before, it kept the soft limit of 128, and
    accept() failed (EMFILE) past it."""
    soft, hard, rpcs = 128, 4096, 128
    proc, port_file = _shard(tmp_path, soft, hard, "--max-concurrent-rpcs", str(rpcs), "--data-port", "0")
    held: list[socket.socket] = []
    try:
        try:
            info = wait_for_port_file(proc, port_file, time.monotonic() + 120)
        except (RuntimeError, TimeoutError) as exc:
            proc.kill()
            raise AssertionError(f"shard {exc}: {proc.communicate()[0]}") from None
        assert _limits(proc.pid) == (RESERVED_FDS + 3 * rpcs, hard)
        # connections waiting for their preface, under the plane's cap on those (--max-concurrent-rpcs)
        for _ in range(rpcs - 8):
            held.append(socket.create_connection(("127.0.0.1", info["data_port"]), timeout=10))
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{proc.pid}/fd")) < soft + 8:  # all accepted: past the old soft limit
            assert time.monotonic() < deadline, f"the shard holds {len(os.listdir(f'/proc/{proc.pid}/fd'))} fds"
            time.sleep(0.05)
        last = held[-1]
        last.sendall(frame_header(5) + b"XXXX\x01")  # a bad preface: answered at once with a status
        last.settimeout(20)
        header = _read(last, HEADER.size)
        size, is_status = split_header(header)
        assert is_status and parse_status(_read(last, size))[0] == "INVALID_ARGUMENT"
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=60)


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "closed without an answer"
        data += chunk
    return data
