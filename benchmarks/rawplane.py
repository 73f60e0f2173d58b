"""The raw data plane's measured prototype, kept for its variants (benchmarks/dataplane.py drives
it): what Python gRPC costs the shard, and what TLS costs a plane written in Python. The shipped
plane is cgx_ps/server/rpc/raw_listener.py (the listener), cgx_ps/server/rpc/raw_stream.py (a
stream's handshake, context and serving through the gate) and cgx_ps/worker/shards/raw_call.py (a
worker's stream), over the one framing in cgx_ps/net/raw_frames.py. This module adds only the
variants' I/O: everything else is the shipped code.

    python -m benchmarks.rawplane server FLAGS...   # `cgx-ps server FLAGS...` plus a raw listener

The shard process is the real one (``ShardServer``: gRPC for Register and everything else, the
same ``ParameterServerService``, session, aggregator, kernels and executor); beside it, on a
second port, an asyncio listener on uvloop takes Exchange streams over plain TCP, one connection
per stream, and serves each with the shipped ``raw_stream.serve_exchange``: the handshake, the
gate (token, draining, error table, refusal log), the plane's ``StreamContext`` and the service's
own ``Exchange``. The shard advertises that port at Register, as it advertises its own data port
(in plaintext: the shipped client keeps TLS streams on gRPC).
So every pushed chunk goes through the same ``read_push``, ``PushAssembler`` (sizes, budget,
deadlines), ``_check_push`` and aggregator (header/crc/meta checks, the fused kernel, the
result's encode) as over gRPC, and each result through the same ``NodeStream`` writer (its cap and
write timeout); only the bytes' way in and out differs.

The shard has two receive paths (``serve_raw``'s ``io``; the shard process reads IO_ENV):
``FrameSocket`` awaits ``sock_recv_into`` per receive, decoding with the shipped ``FrameReader``;
"protocol" is the shipped listener (``cgx_ps.server.rpc.raw_listener.DataPlane``, a
BufferedProtocol that uvloop fills from its own callback: no coroutine per receive).

The nodes are the shipped ``ShardClient`` with CGX_PS_DATAPLANE=raw (``raw_plane_client``), whose
stream is the worker's ``RawCall``. With ``--tls-cert`` (and ``--tls-client-ca``) the listener
speaks TLS with the same files, through Python's ``ssl`` on memory BIOs (``TlsFrameSocket``), and
the nodes' streams (``TlsShardClient``) too: what TLS costs a data plane written in Python; a
native one would use its TLS library (or kernel TLS) directly. What the "sock" and TLS variants
leave out, compared with the shipped listener: its connection cap and pending-connection
eviction, the frame timeout, keepalive, and pausing reads between frames (a slow service lets
the kernel's buffer fill, not TCP's window); and with TLS, certificate reloading (tls.py) and ALPN.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import sys
from pathlib import Path
from typing import Any

import grpc

from cgx_ps.net.raw_frames import (MAX_CHALLENGE, MAX_FRAME, Frame, FrameReader, FrameTooLarge, frame_header, opening,
                                   parse_challenge, parse_status, preface, proof, receive_frame,
                                   set_stream_options)
from cgx_ps.server.errors import BadRequest
from cgx_ps.server.rpc.gate import Gate
from cgx_ps.server.rpc.raw_listener import DataPlane
from cgx_ps.server.rpc.raw_stream import serve_exchange
from cgx_ps.server.rpc.service import FIRST_MESSAGE_TIMEOUT_S, ParameterServerService
from cgx_ps.worker.errors import StreamEnded
from cgx_ps.worker.shards.client import ShardClient, read_result
from cgx_ps.worker.shards.connection import ShardConnection

__all__ = ["IO_ENV", "MAX_FRAME", "FrameSocket", "TlsCall", "TlsFrameSocket", "TlsShardClient", "raw_plane_client",
           "serve_raw"]

IO_ENV = "CGX_PS_BENCH_RAW_IO"  # "sock" (default) or "protocol": serve_raw's io, for the shard process


class FrameSocket:
    """Frames on a non-blocking socket, through the running loop's sock_* calls, decoded in place
    by the shipped ``FrameReader``: the shard's side of the "sock" variant (raw_stream.FrameStream)
    and both sides of the TLS one."""

    def __init__(self, sock: socket.socket, peer: str = "unknown") -> None:
        sock.setblocking(False)
        set_stream_options(sock)
        self.sock = sock
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        self._reader = FrameReader()

    async def _recv_into(self, view: memoryview) -> int:
        """Receive into ``view``: the bytes received, 0 at the peer's EOF."""
        return await self.loop.sock_recv_into(self.sock, view)

    async def read(self, limit: int = MAX_FRAME) -> Frame | None:
        """The next frame; None at a clean EOF between frames. A frame over ``limit`` is refused
        on its header (BadRequest), EOF inside a frame is a ConnectionResetError."""
        self._reader.limit = limit
        try:
            return await receive_frame(self._reader, self._recv_into)
        except FrameTooLarge as exc:
            raise BadRequest(str(exc)) from None

    async def write(self, data: Any, status: bool = False) -> None:
        """One frame; ``data`` is sent as it is (the kernel copies it, Python does not)."""
        view = memoryview(data)
        await self.loop.sock_sendall(self.sock, frame_header(view.nbytes, status))
        await self.loop.sock_sendall(self.sock, view)

    def close(self) -> None:
        self.sock.close()


class TlsFrameSocket(FrameSocket):
    """The same frames through Python's ssl on memory BIOs (the loop's sock_* calls cannot take an
    SSLSocket): ciphertext is received into one reused buffer and decrypted straight into the
    frame's buffer; a frame is encrypted into the outgoing BIO and sent from there (a copy per
    node for a result: each connection has its own keys, as over gRPC)."""

    _CIPHER_BUFFER = 1 << 18

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None, peer: str = "unknown") -> None:
        super().__init__(sock, peer)
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self._cipher = bytearray(self._CIPHER_BUFFER)
        self._sending = asyncio.Lock()  # the reader answers the handshake too: one sender at a time

    async def handshake(self) -> None:
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._feed():
                    raise ConnectionResetError("connection closed during the TLS handshake") from None
        await self._flush()

    async def _flush(self) -> None:
        async with self._sending:  # taken from the BIO under the lock, so records go out in order
            while self._out.pending:
                await self.loop.sock_sendall(self.sock, self._out.read())

    async def _feed(self) -> bool:
        n = await self.loop.sock_recv_into(self.sock, self._cipher)
        if n == 0:
            self._in.write_eof()
            return False
        self._in.write(memoryview(self._cipher)[:n])
        return True

    async def _recv_into(self, view: memoryview) -> int:
        while True:
            try:
                return self.tls.read(len(view), view)
            except ssl.SSLWantReadError:
                await self._flush()  # a TLS 1.3 key update or ticket may want an answer
                if not await self._feed():
                    return 0
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    async def write(self, data: Any, status: bool = False) -> None:
        view = memoryview(data)
        self.tls.write(frame_header(view.nbytes, status))
        self.tls.write(view)
        await self._flush()


def _server_tls(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """The raw listener's TLS, as the gRPC port's (tls.py): the shard's certificate, and a client
    certificate required when a client CA is given."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    return context


# ---- the shard's side ------------------------------------------------------------------------------

async def _serve_connection(gate: Gate, frames: FrameSocket) -> None:
    """One connection, served as the shipped listener serves one (raw_stream.serve_exchange), after
    the TLS handshake of a TLS variant."""
    try:
        if isinstance(frames, TlsFrameSocket):
            await asyncio.wait_for(frames.handshake(), FIRST_MESSAGE_TIMEOUT_S)
        await serve_exchange(frames, gate, FIRST_MESSAGE_TIMEOUT_S)
    except (asyncio.TimeoutError, OSError):  # ssl.SSLError is one: a failed TLS handshake
        pass
    finally:
        frames.close()


async def serve_raw(service: ParameterServerService, token: bytes | None, host: str,
                    tls: ssl.SSLContext | None = None, io: str = "sock") -> tuple[int, asyncio.Task]:
    """Listen on ``host``, a free port; (the port, the task serving it: cancel it to stop).
    ``io``: "sock" (FrameSocket, or TlsFrameSocket with ``tls``) or "protocol" (the shipped
    listener, server/rpc/raw_listener.py; plaintext only)."""
    gate = Gate(service, token)  # the gRPC port's own checks, as the shipped listener shares them
    if io == "protocol":
        if tls is not None:
            raise ValueError("the protocol variant is plaintext only")
        return await _serve_protocol(service, gate, host)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(64)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    connections: set[asyncio.Task] = set()

    async def accept() -> None:
        try:
            while True:
                sock, addr = await loop.sock_accept(listener)
                peer = f"ipv4:{addr[0]}:{addr[1]}"
                frames = FrameSocket(sock, peer) if tls is None else TlsFrameSocket(sock, tls, True, peer=peer)
                task = asyncio.create_task(_serve_connection(gate, frames))
                connections.add(task)
                task.add_done_callback(connections.discard)
        finally:
            listener.close()
            for task in connections:
                task.cancel()

    return listener.getsockname()[1], asyncio.create_task(accept())


async def _serve_protocol(service: ParameterServerService, gate: Gate, host: str) -> tuple[int, asyncio.Task]:
    """The shipped listener (its gate, cap, timeouts) on a free port; cancel the task to close it."""
    plane = DataPlane(service, gate, max_connections=1024)
    port = await plane.start(host, 0)

    async def serve() -> None:
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            await plane.close(grace_s=0)

    return port, asyncio.create_task(serve())

async def _serve(argv: list[str]) -> int:
    """``cgx-ps server`` (main.py's ShardServer), plus the raw listener; the port file also
    names ``raw_port``."""
    from cgx_ps.cli import build_parser
    from cgx_ps.server.config import ServerConfig
    from cgx_ps.server.main import ShardServer, setup_logging

    args = build_parser().parse_args(argv)
    config = ServerConfig.from_flags(vars(args))
    setup_logging(config.log_level, config.shard_index)
    server = ShardServer(config)
    await server.start()
    tls = _server_tls(config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls_cert else None
    # the benchmark's variant of the listener's I/O (benchmarks/dataplane.py sets it)
    io = os.environ.get(IO_ENV, "sock")
    raw_port, acceptor = await serve_raw(server.service, server.token, config.host, tls, io)
    if tls is None:  # advertised at Register: the nodes' ShardClient finds it there (TlsShardClient is told)
        server.service.data_port = raw_port
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # cluster.launch_shard blocked it
    port_file = Path(args.port_file)
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"port": server.port, "metrics_port": server.metrics_port,
                               "health_port": server.health_port, "raw_port": raw_port, "pid": os.getpid()}))
    os.replace(tmp, port_file)
    await stop.wait()
    acceptor.cancel()
    await server.stop(drain=True)
    return 0


# ---- the node's side -------------------------------------------------------------------------------

def raw_plane_client(address: str, node_id: str, nodes: int, layout: Any, security: Any, raw_port: int) -> ShardClient:
    """A node whose Exchange streams go over the raw listener at ``raw_port``: the shipped
    ShardClient on CGX_PS_DATAPLANE=raw (the shard advertises the port) in plaintext; under TLS,
    which the shipped plane refuses, ``TlsShardClient``."""
    if security.tls_ca:
        return TlsShardClient(address, node_id, nodes, layout, security=security, raw_port=raw_port)
    return ShardClient(address, node_id, nodes, layout, security=security, dataplane="raw")


class TlsCall:
    """One Exchange stream over a TLS connection to the listener, an ExchangeCall
    (cgx_ps/worker/shards/exchange_call.py) as the worker's RawCall is, which is plaintext only:
    the handshake of the framing, ``write``, ``cancel`` and async iteration over the results,
    ending with StreamEnded carrying the shard's status (as gRPC's trailers would), UNAVAILABLE
    when the connection breaks."""

    plane = "raw"

    def __init__(self, frames: TlsFrameSocket) -> None:
        self.frames = frames

    @classmethod
    async def open(cls, host: str, port: int, token: bytes, tls: ssl.SSLContext) -> "TlsCall":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        frames = None
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
            frames = TlsFrameSocket(sock, tls, server_side=False, server_hostname=host)
            await frames.handshake()
            await frames.write(opening())  # the handshake (cgx_ps/net/raw_frames.py): the proof of the token
            answer = await frames.read(MAX_CHALLENGE)
            nonce = parse_challenge(answer[1]).nonce if answer is not None and not answer[0] else b""
            if not nonce:
                raise ConnectionResetError(f"no challenge from the shard: {answer!r:.200}")
            await frames.write(preface(proof(token, nonce)))
        except (OSError, BadRequest) as exc:  # ssl.SSLError is an OSError
            (frames or sock).close()
            raise StreamEnded("UNAVAILABLE", f"raw data plane {host}:{port}: {exc}") from None
        return cls(frames)

    async def write(self, frame: Any) -> None:
        try:
            await self.frames.write(frame)
        except OSError as exc:
            raise StreamEnded("UNAVAILABLE", f"stream closed: {exc}") from None

    def cancel(self) -> None:
        self.frames.close()

    def __aiter__(self):
        return self._results()

    async def _results(self):
        try:
            while (frame := await self.frames.read()) is not None:
                status, body = frame
                if status:
                    name, details = parse_status(body)
                    if name == "OK":  # the listener's clean end
                        return
                    raise StreamEnded(name if name in grpc.StatusCode.__members__ else "UNKNOWN", details)
                yield read_result(body)
        except (OSError, BadRequest) as exc:
            raise StreamEnded("UNAVAILABLE", f"stream broke: {exc}") from None


class _TlsPlaneConnection(ShardConnection):
    """ShardConnection (Register and everything else over gRPC with TLS) whose Exchange streams go
    over the TLS listener at ``raw_port``, with the gRPC channel's TLS files (security.py)."""

    raw_port = 0
    tls: ssl.SSLContext | None = None

    async def open_exchange(self) -> TlsCall:
        if self.tls is None:  # the CA, a client certificate
            self.tls = ssl.create_default_context(cafile=self.security.tls_ca)
            if self.security.tls_cert:
                self.tls.load_cert_chain(self.security.tls_cert, self.security.tls_key)
        return await TlsCall.open(self.address.rsplit(":", 1)[0], self.raw_port, self._token, self.tls)


class TlsShardClient(ShardClient):
    """ShardClient (its pushes, results, recovery and futures unchanged) whose Exchange streams go
    over the TLS listener at ``raw_port``."""

    connection_type = _TlsPlaneConnection

    def __init__(self, *args: Any, raw_port: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection.raw_port = raw_port


if __name__ == "__main__":
    import uvloop

    sys.exit(uvloop.run(_serve(sys.argv[1:])))
