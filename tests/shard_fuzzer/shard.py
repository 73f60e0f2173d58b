"""The shard under test (its own process, or in the fuzzer's for debugging) and what watches
it during the fuzz: its RSS, and how fast its health service answers."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cgx_ps.server.cluster import launch_shard, wait_for_port_file

from .settings import CAPACITY, HEALTH_EVERY_S, MAX_INFLIGHT_MB, MAX_MODEL_MB, REPO, ROUND_TIMEOUT_S

def shard_flags(token_file: str) -> list[str]:
    return ["--host", "127.0.0.1", "--port", "0", "--token-file", token_file,
            "--metrics-port", "-1", "--round-timeout", str(ROUND_TIMEOUT_S), "--max-inflight-mb", str(MAX_INFLIGHT_MB),
            "--max-model-mb", str(MAX_MODEL_MB), "--drain-timeout", "2", "--log-level", "INFO"]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class SubprocessShard:
    """``python -m cgx_ps.cli server`` with its stdout and stderr in a file."""

    def __init__(self, workdir: Path, token_file: str) -> None:
        self.workdir, self.token_file = workdir, token_file
        self.log_path = workdir / "shard.log"
        self.proc: subprocess.Popen | None = None
        self.address = ""

    async def start(self, timeout_s: float = 120.0) -> None:
        port_file = self.workdir / "port.json"
        with open(self.log_path, "wb") as out:  # the child keeps its own descriptor
            self.proc = launch_shard(shard_flags(self.token_file), port_file, stdout=out, stderr=subprocess.STDOUT,
                                     cwd=REPO)
        try:
            info = await asyncio.to_thread(wait_for_port_file, self.proc, port_file, time.monotonic() + timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"the shard {exc}: {self.log_path.read_text()[-2000:]}") from None
        self.address = f"127.0.0.1:{info['port']}"

    def rss_kib(self) -> int:
        return rss_kib(self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    async def stop(self) -> int | None:
        """SIGTERM (the graceful drain) and its exit status; killed after 20 s."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        for _ in range(200):
            if self.proc.poll() is not None:
                return self.proc.returncode
            await asyncio.sleep(0.1)
        self.proc.kill()
        return self.proc.wait()


class InProcessShard:
    """A ShardServer in the fuzzer's own event loop, for debugging (breakpoints, tracebacks): its
    RSS is then the fuzzer's too, and gRPC's own stderr lines are not in its log."""

    def __init__(self, workdir: Path, token_file: str) -> None:
        self.log_path = workdir / "shard.log"
        self.token_file = token_file
        self.server = None
        self.address = ""
        self._handler: logging.Handler | None = None

    async def start(self) -> None:
        from cgx_ps.server import ServerConfig, ShardServer
        self._handler = logging.FileHandler(self.log_path)
        self._handler.setFormatter(logging.Formatter(
            "%(asctime)s level=%(levelname)s shard=0 pid=%(process)d logger=%(name)s msg=%(message)r"))
        logger = logging.getLogger("cgx_ps")
        logger.addHandler(self._handler)
        logger.setLevel(logging.INFO)
        self.server = ShardServer(ServerConfig(
            host="127.0.0.1", port=0, metrics_port=-1, round_timeout_s=ROUND_TIMEOUT_S, drain_timeout_s=2.0,
            max_inflight_bytes=CAPACITY, max_model_bytes=MAX_MODEL_MB << 20, token_file=self.token_file))
        await self.server.start()
        self.address = f"127.0.0.1:{self.server.port}"

    def rss_kib(self) -> int:
        return rss_kib(os.getpid())

    def alive(self) -> bool:
        return self.server is not None and not self.server._stopping

    def log_lines(self) -> list[str]:
        self._handler.flush()
        return self.log_path.read_text(errors="replace").splitlines()

    async def stop(self) -> int | None:
        await self.server.stop(drain=True)
        logging.getLogger("cgx_ps").removeHandler(self._handler)
        self._handler.close()
        return 0


class RssSampler:
    """The shard's RSS, sampled every 50 ms while the fuzz runs."""

    def __init__(self, shard) -> None:
        self.shard, self.samples, self._task = shard, [], None

    async def _run(self) -> None:
        while True:
            try:
                self.samples.append(self.shard.rss_kib())
            except OSError:
                return  # the process is gone: the report says so
            await asyncio.sleep(0.05)

    @property
    def peak_kib(self) -> int:
        return max(self.samples, default=0)

    def quarter_peaks_kib(self) -> list[int]:
        """The peak of each quarter of the run: a plateau, not a climb, if nothing leaks."""
        n = len(self.samples)
        return [max(self.samples[i * n // 4:(i + 1) * n // 4], default=0) for i in range(4)]

    def __enter__(self) -> "RssSampler":
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()


class HealthWatch:
    """Asks the health service every HEALTH_EVERY_S while the fuzz runs and keeps the slowest
    answer: how long the shard's event loop was ever too busy to serve anyone."""

    def __init__(self, address: str) -> None:
        self.address, self.worst_s, self.failures, self._task = address, 0.0, 0, None

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                t0 = time.monotonic()
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=60)
                except grpc.aio.AioRpcError:
                    self.failures += 1
                self.worst_s = max(self.worst_s, time.monotonic() - t0)
                await asyncio.sleep(HEALTH_EVERY_S)

    def __enter__(self) -> "HealthWatch":
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()
