"""One shard process: grpc.aio on uvloop, health service, metrics, graceful drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from ..v1 import ps_pb2_grpc
from .config import GRPC_OPTIONS, ServerConfig
from .metrics import ShardMetrics
from .service import ParameterServerService

__all__ = ["ShardServer", "run_server", "config_from_args", "setup_logging"]

log = logging.getLogger("cgx_ps.server")
SERVICE_NAME = "cgx_ps.v1.ParameterServer"


class ShardServer:
    """A shard you can start inside a running event loop (tests) or from ``run_server``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ShardMetrics(config.shard_index)
        threads = config.kernel_threads or len(os.sched_getaffinity(0))
        # Kernel work (decode-accumulate, re-encode) runs here; the kernels release the GIL.
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cgx-shard")
        self.service = ParameterServerService(config, self.executor, self.metrics)
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._stopping = False
        self.metrics_port = -1
        self._server: grpc.aio.Server | None = None
        self._metrics_httpd = None

    async def start(self) -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        ps_pb2_grpc.add_ParameterServerServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        await server.start()
        self._server = server
        if self.config.metrics_port >= 0:
            self._metrics_httpd, _ = start_http_server(self.config.metrics_port, registry=self.metrics.registry)
            self.metrics_port = self._metrics_httpd.server_port
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on %s:%d (shard %d of %d, metrics port %d)", self.config.host, self.port,
                 self.config.shard_index, self.config.num_shards, self.metrics_port)

    async def stop(self, drain: bool = True) -> None:
        """NOT_SERVING, finish the rounds in flight (up to drain_timeout_s), then stop. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        await self.health.enter_graceful_shutdown()
        self.service.draining = True
        if drain:
            deadline = time.monotonic() + self.config.drain_timeout_s
            while self.service.rounds_in_flight() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            left = self.service.rounds_in_flight()
            if left:
                log.warning("drain timeout: %d block rounds still incomplete", left)
        self.service.close_streams("shard is shutting down")
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        self.executor.shutdown(wait=True)
        log.info("stopped")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host, port=args.port, metrics_port=args.metrics_port,
        shard_index=args.shard_index, num_shards=args.num_shards,
        round_timeout_s=args.round_timeout, drain_timeout_s=args.drain_timeout,
        max_inflight_bytes=int(args.max_inflight_mb * (1 << 20)), error_feedback=args.error_feedback,
        kernel_threads=args.kernel_threads,
    )


class _ShardFilter(logging.Filter):
    def __init__(self, shard: int) -> None:
        super().__init__()
        self.shard = shard

    def filter(self, record: logging.LogRecord) -> bool:
        record.shard = self.shard
        return True


def setup_logging(level: str, shard: int) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_ShardFilter(shard))
    handler.setFormatter(logging.Formatter(
        "%(asctime)s level=%(levelname)s shard=%(shard)s pid=%(process)d logger=%(name)s msg=%(message)r"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


async def _serve(config: ServerConfig, port_file: str | None) -> int:
    server = ShardServer(config)
    await server.start()
    if port_file:
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"port": server.port, "metrics_port": server.metrics_port, "pid": os.getpid()}, f)
        os.replace(tmp, port_file)  # readers never see a half-written file
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: draining")
    await server.stop(drain=True)
    return 0


def run_server(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"cgx-ps server: {exc}") from None
    setup_logging(args.log_level, config.shard_index)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.run(_serve(config, args.port_file))
    return uvloop.run(_serve(config, args.port_file))
