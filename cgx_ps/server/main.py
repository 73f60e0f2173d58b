"""One shard process: grpc.aio on uvloop, health service, metrics, graceful drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from .. import timeline
from ..net.addresses import bare_host, host_port
from ..kernels.warm import DEFAULT_WIDTH, warm_in_background
from ..net.security import CredentialError, read_token
from .process.allocator import keep_freed_memory
from .config import GRPC_OPTIONS, HEALTH_PORT_CALLS, ServerConfig
from .rpc.raw_listener import DataPlane
from .process.fdlimit import FdAction, raise_fd_limit
from .metrics import ShardMetrics
from .rpc.gate import SERVICE_NAME, add_parameter_server, add_wrong_port_answer
from .rpc.service import ParameterServerService
from .rpc.shard_status import ShardStatus
from .rounds.kernel_threads import executor_threads, usable_cpus
from .rpc.tls import ReloadingServerCredentials

__all__ = ["ShardServer", "exposure_problem", "run_server", "setup_logging"]

log = logging.getLogger("cgx_ps.server")

# gRPC servers set SO_REUSEPORT by default, so a second shard started on a port already in use
# did not fail: both listened and the kernel split connections between them, sending a worker's
# blocks to a shard that does not own them. Exclusive ports make that a start-up error.
_EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]


def is_loopback(host: str) -> bool:
    """Is ``host`` reachable from this machine only?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare_host(host)).is_loopback
    except ValueError:
        return False  # a name: assume it resolves beyond this machine


def exposure_problem(config: ServerConfig) -> str | None:
    """Why a shard will not start as asked, or None: a non-loopback address with neither a job token
    nor TLS serves anyone who reaches it (the job's broadcasts, its gradients), so it takes
    ``--insecure`` to say that is meant, as Redis's protected mode and Jupyter's token do."""
    if is_loopback(config.host) or config.token_file or config.tls_cert or config.insecure:
        return None
    return (f"refusing to serve {config.host} with neither --token-file nor --tls-cert: anyone who reaches the "
            f"port could join the job. Give a token (--token-file, CGX_PS_TOKEN_FILE) or TLS, bind loopback "
            f"(--host 127.0.0.1), or pass --insecure (CGX_PS_INSECURE=1) on a network you trust")


def exposure_warning(config: ServerConfig) -> str | None:
    """The one warning a shard open to the network without token or TLS logs at start."""
    if is_loopback(config.host) or config.token_file or config.tls_cert:
        return None
    ports = "these ports (gRPC and the data plane)" if config.data_port >= 0 else "this port"
    return (f"listening on {config.host} with neither --token-file nor --tls-cert: anyone who can reach {ports} "
            f"can read the job's broadcasts and push gradients (docs/security.md)")


def _data_port_words(server: "ShardServer") -> str:
    """The data port as the start line names it: a free port picked for it says so (a firewall must
    let the workers reach it, or they use gRPC after one warning)."""
    if server.dataplane is None:
        return "off"
    return f"{server.data_port}, a free one: --data-port N fixes it" if server.config.data_port == 0 \
        else str(server.data_port)


class ShardServer:
    """A shard you can start inside a running event loop (tests) or from ``run_server``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ShardMetrics(config.shard_index)
        # Kernel work (checking pushes, summing and re-encoding a round) runs here; the kernels release the GIL.
        self.executor = ThreadPoolExecutor(max_workers=executor_threads(config.kernel_threads, usable_cpus()),
                                           thread_name_prefix="cgx-shard")
        self.service = ParameterServerService(config, self.executor, self.metrics)
        self.status = ShardStatus(self.service)  # the Status RPC and session gauges
        self.health = health.aio.HealthServicer()
        # Read at start so a bad file stops the shard with a message naming it.
        self.token = read_token(config.token_file).encode() if config.token_file else None
        self.tls = (ReloadingServerCredentials(config.tls_cert, config.tls_key, config.tls_client_ca)
                    if config.tls_cert else None)
        self.port = 0
        self.health_port = -1
        self.data_port = -1  # the raw data plane's, when --data-port asks for one
        self.dataplane: DataPlane | None = None
        self._stopping = False
        self.metrics_port = -1
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._metrics_httpd = None
        self._timeline: timeline.Recorder | None = None

    def _bind(self, server: grpc.aio.Server, port: int, secure: bool, flag: str) -> int:
        address = host_port(self.config.host, port)
        try:
            bound = (server.add_secure_port(address, self.tls.credentials) if secure and self.tls is not None
                     else server.add_insecure_port(address))
        except RuntimeError:  # grpcio raises this, not OSError, for a port in use
            bound = 0
        if bound == 0:
            raise OSError(f"cannot bind {address}: the port is in use or the address is not this host's "
                          f"(another shard on it?); choose another {flag}")
        return bound

    async def start(self) -> None:
        self._timeline = timeline.start_shard(self.config.timeline, self.config.timeline_steps,
                                              self.config.shard_index, self.config.num_shards)
        server = grpc.aio.server(options=GRPC_OPTIONS + _EXCLUSIVE_PORT,
                                 maximum_concurrent_rpcs=self.config.max_concurrent_rpcs)
        gate = add_parameter_server(server, self.service, self.token, status=self.status)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.port = self._bind(server, self.config.port, secure=True, flag="--port")
        if self.config.health_port >= 0:
            # Kubelet gRPC probes speak plaintext: with TLS on, they get a port of their own that
            # serves the health service and nothing else.
            self._health_server = grpc.aio.server(options=_EXCLUSIVE_PORT, maximum_concurrent_rpcs=HEALTH_PORT_CALLS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
            add_wrong_port_answer(self._health_server, f"this is shard {self.config.shard_index}'s health-only port "
                                                       f"(--health-port); its gRPC port is {self.port}")
            self.health_port = self._bind(self._health_server, self.config.health_port, secure=False,
                                          flag="--health-port")
        if self.config.metrics_port >= 0:
            host = bare_host(self.config.metrics_host or self.config.host)
            try:
                self._metrics_httpd, _ = start_http_server(self.config.metrics_port, addr=host,
                                                           registry=self.metrics.registry)
            except OSError as exc:
                raise OSError(f"cannot serve metrics on {host_port(host, self.config.metrics_port)}: {exc.strerror}; "
                              f"choose another --metrics-port (or -1 to disable)") from None
            self.metrics_port = self._metrics_httpd.server_port
        if self.config.data_port >= 0:
            # same gate, same service, same cap on streams as the gRPC port (server/rpc/raw_listener.py)
            self.dataplane = DataPlane(self.service, gate, self.config.max_concurrent_rpcs)
            self.data_port = self.service.data_port = await self.dataplane.start(bare_host(self.config.host),
                                                                                 self.config.data_port)
        # Serve at once and have the default width's kernels ready by the first round: loading
        # them from numba's cache takes about a second, compiling them cold (a new pod's empty
        # cache) about 4 s of one core (kernels/warm.py). A round that needs them sooner, or
        # another width, waits for its compile. Started once every port is bound: a shard that
        # cannot start says so in one line and exits, with no compile to wait for.
        warm_in_background([DEFAULT_WIDTH], "shard")
        await server.start()
        self._server = server
        if self._health_server is not None:
            await self._health_server.start()
        warning = exposure_warning(self.config)
        if warning:
            log.warning(warning)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on %s (shard %d of %d, metrics port %d, data port %s)", host_port(self.config.host, self.port),
                 self.config.shard_index, self.config.num_shards, self.metrics_port, _data_port_words(self))

    async def stop(self, drain: bool = True) -> None:
        """NOT_SERVING, finish the rounds in flight (up to drain_timeout_s), then stop. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        await self.health.enter_graceful_shutdown()
        self.service.draining = True
        if self.dataplane is not None:
            self.dataplane.stop_accepting()  # the streams open finish their rounds in the drain
        if drain:
            deadline = time.monotonic() + self.config.drain_timeout_s
            while self.service.rounds_in_flight() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            left = self.service.rounds_in_flight()
            if left:
                log.warning("drain timeout: %d block rounds still incomplete", left)
        self.service.close_streams("shard is shutting down")
        if self.dataplane is not None:
            await self.dataplane.close(grace_s=1.0)
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self._health_server is not None:
            await self._health_server.stop(grace=None)
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        self.executor.shutdown(wait=True)
        written = timeline.stop(self._timeline)
        if written:
            log.info("timeline written to %s", written)
        log.info("stopped")
        self.status.close()


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
    try:
        server = ShardServer(config)
        await server.start()
    except (CredentialError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the port file says we serve: its reader may signal us
        loop.add_signal_handler(sig, stop.set)
    if server.tls is not None:
        loop.add_signal_handler(signal.SIGHUP, server.tls.request_reload)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by a launcher until now (cluster.py)
    if port_file:
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"port": server.port, "metrics_port": server.metrics_port, "health_port": server.health_port,
                       "data_port": server.data_port, "pid": os.getpid()}, f)
        os.replace(tmp, port_file)  # readers never see a half-written file
    await stop.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # One signal stops the shard; a later one changes nothing, also once the loop is closed
        # (whose own handlers would then be Python's: a KeyboardInterrupt traceback, or death by
        # SIGTERM after a clean stop). `cgx-ps cluster` passes a SIGINT on to its shards, which
        # a terminal's Ctrl-C has often reached already.
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    log.info("signal received: draining")
    await server.stop(drain=True)
    return 0


def run_server(args: argparse.Namespace) -> int:
    """``cgx-ps server``: run one parameter-server shard until SIGTERM or Ctrl-C, then drain.

    Args:
        args: the parsed flags of ``cgx-ps server`` (``cli.commands.build_parser``), with the
            environment's defaults (``CGX_PS_*``) already applied.

    Returns:
        The exit status: 0 after a clean stop, 2 for flags that do not fit together or an
        exposed address with neither token nor TLS (said on stderr), 1 when serving failed.
    """
    try:
        config = ServerConfig.from_flags(vars(args))
    except ValueError as exc:  # flags that do not fit together: a usage error (argparse's exit status 2)
        print(f"cgx-ps server: {exc}", file=sys.stderr)
        return 2
    problem = exposure_problem(config)
    if problem is not None:
        print(f"cgx-ps server: {problem}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.shard_index)
    keep_freed_memory()  # this process is a shard: its buffers come back every round (allocator.py)
    fds = raise_fd_limit(config)  # this process is a shard: its caps' connections need descriptors (fdlimit.py)
    if fds.action is FdAction.SHORT:
        log.warning("%s", fds.problem)
    elif fds.action is FdAction.RAISE:
        log.info("open-file limit raised to %d for the caps (--max-concurrent-rpcs %d)", fds.soft,
                 config.max_concurrent_rpcs)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.run(_serve(config, args.port_file))
    return uvloop.run(_serve(config, args.port_file))
