"""The raw data plane's measured prototype, kept for its variants (benchmarks/dataplane.py drives
it): what Python gRPC costs the shard, and what TLS costs a plane written in Python. The shipped
plane is cgx_ps/server/rpc/raw_listener.py (the listener) and cgx_ps/worker/shards/raw_call.py (a worker's
stream), over the one framing in cgx_ps/net/raw_frames.py, which this module speaks too; its
"protocol" receive path *is* the shipped listener.

    python -m benchmarks.rawplane server FLAGS...   # `cgx-ps server FLAGS...` plus a raw listener

The shard process is the real one (``ShardServer``: gRPC for Register and everything else, the
same ``ParameterServerService``, session, aggregator, kernels and executor); beside it, on a
second port, an asyncio listener on uvloop takes Exchange streams over plain TCP, one connection
per stream, and hands each to the service's own ``Exchange`` handler through a context object
with the three calls it uses (``read``, ``write``, ``abort``). So every pushed chunk goes through
the same ``read_push``, ``PushAssembler`` (sizes, budget, deadlines), ``_check_push`` and
aggregator (header/crc/meta checks, the fused kernel, the result's encode) as over gRPC, and each
result through the same ``NodeStream`` writer (its cap and write timeout); only the bytes' way in
and out differs.

The wire (cgx_ps/net/raw_frames.py): frames of a 4-byte little-endian length and that many bytes. A
connection starts with the handshake (the worker's opening, the shard's challenge of a fresh
nonce, the worker's preface with an HMAC of it keyed by the job token: checked once,
``hmac.compare_digest``; the token itself never travels), then the Exchange stream's
messages exactly as gRPC carries them (a serialized Hello, then ``chunkframes`` pushes; results
are ``frames.result_frames``' bytes, built once and sent to every node as they are, by
``sock_sendall`` on the same object: no per-node copy). The shard receives each frame into a
buffer of its announced size (``sock_recv_into``), refusing one over gRPC's 8 MiB message limit
before it allocates. A stream's end carries a status frame (the length's top bit set:
"CODE\\ndetails"), standing in for gRPC's trailers.

The shard has two receive paths (``serve_raw``'s ``io``; the shard process reads IO_ENV):
``FrameSocket`` awaits ``sock_recv_into`` per receive; "protocol" is the shipped listener
(``cgx_ps.server.rpc.raw_listener.DataPlane``, a BufferedProtocol that uvloop fills from its own
callback: no coroutine per receive). The nodes always use FrameSocket.

With ``--tls-cert`` (and ``--tls-client-ca``) the listener speaks TLS with the same files, through
Python's ``ssl`` on memory BIOs (``TlsFrameSocket``): what TLS costs a data plane written in
Python; a native one would use its TLS library (or kernel TLS) directly.

What the "sock" and TLS variants leave out, compared with gRPC (the shipped listener adds them):
- certificate reloading (tls.py) and ALPN;
- HTTP/2 flow control and multiplexing: a slow reader is held up by TCP's window and the
  NodeStream's write timeout only, and each stream is a connection of its own;
- keepalive pings (a dead peer is noticed by TCP or the round timeout only);
- gRPC's connection management on the client (reconnect backoff, wait-for-ready, name
  resolution): the client below connects once per stream;
- the per-call gate's draining rule and rate-limited refusal log (rpc.py): Exchange streams pass
  a draining shard's gate anyway; a refusal here is one status frame and no log line;
- ``maximum_concurrent_rpcs``: connections are not counted or capped (the first frame's 30 s
  timeout is kept).
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

import grpc
import numpy as np

from cgx_ps.net.raw_frames import (HEADER, MAX_CHALLENGE, MAX_FRAME, MAX_PREFACE, challenge, frame_header, new_nonce,
                              opening, parse_challenge, parse_preface, parse_status, preface, proof, split_header,
                              status_body)
from cgx_ps.server.rpc.raw_listener import DataPlane, presented_token
from cgx_ps.server.errors import BadRequest, ProtocolError, TimedOut, Unauthenticated
from cgx_ps.server.rpc.gate import Gate, grpc_status
from cgx_ps.server.rpc.service import FIRST_MESSAGE_TIMEOUT_S, ParameterServerService
from cgx_ps.worker.errors import StreamEnded
from cgx_ps.worker.shards.client import ShardClient, read_result
from cgx_ps.worker.shards.connection import ShardConnection

__all__ = ["IO_ENV", "MAX_FRAME", "FrameSocket", "RawCall", "RawShardClient", "TlsFrameSocket", "serve_raw"]

IO_ENV = "CGX_PS_BENCH_RAW_IO"  # "sock" (default) or "protocol": serve_raw's io, for the shard process
_SMALL = 1 << 16  # frames below this are handed on as bytes (a Hello, a status), larger ones as read


class FrameSocket:
    """Length-prefixed frames on a non-blocking socket, through the running loop's sock_* calls."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._header = bytearray(HEADER.size)

    async def _fill(self, view: memoryview) -> int:
        """Receive into all of ``view``; the bytes received (fewer only at the peer's EOF)."""
        got = 0
        while got < len(view):
            n = await self.loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                return got
            got += n
        return got

    async def read(self, limit: int) -> tuple[bool, bytes | memoryview] | None:
        """(is_status, body) of the next frame; None at a clean EOF between frames. A frame over
        ``limit`` is refused before anything is allocated for it; EOF inside a frame is an error."""
        got = await self._fill(memoryview(self._header))
        if got == 0:
            return None
        if got < HEADER.size:
            raise ConnectionResetError("connection closed inside a frame header")
        size, status = split_header(self._header)
        if size > limit:
            raise BadRequest(f"frame of {size} bytes; at most {limit}")
        # Not zeroed (a bytearray would be, a memset of every byte the socket then overwrites):
        # numpy's empty is malloc's memory as it is.
        body = memoryview(np.empty(size, np.uint8))
        if await self._fill(body) < size:
            raise ConnectionResetError(f"connection closed inside a frame of {size} bytes")
        return status, body.tobytes() if size < _SMALL else body

    async def write(self, data: bytes | bytearray | memoryview, status: bool = False) -> None:
        """One frame; ``data`` is sent as it is (the kernel copies it, Python does not)."""
        await self.loop.sock_sendall(self.sock, frame_header(len(data), status))
        await self.loop.sock_sendall(self.sock, data)

    def close(self) -> None:
        self.sock.close()


class TlsFrameSocket(FrameSocket):
    """The same frames through Python's ssl on memory BIOs (the loop's sock_* calls cannot take an
    SSLSocket): ciphertext is received into one reused buffer and decrypted straight into the
    frame's buffer; a frame is encrypted into the outgoing BIO and sent from there (a copy per
    node for a result: each connection has its own keys, as over gRPC)."""

    _CIPHER_BUFFER = 1 << 18

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None) -> None:
        super().__init__(sock)
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

    async def _fill(self, view: memoryview) -> int:
        got = 0
        while got < len(view):
            try:
                n = self.tls.read(len(view) - got, view[got:])
            except ssl.SSLWantReadError:
                await self._flush()  # a TLS 1.3 key update or ticket may want an answer
                if not await self._feed():
                    return got
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return got
            if n == 0:
                return got
            got += n
        return got

    async def write(self, data: bytes | bytearray | memoryview, status: bool = False) -> None:
        self.tls.write(frame_header(len(data), status))
        self.tls.write(data)
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

class _Aborted(Exception):
    """The handler ended the stream with a status (as grpc.aio's AbortError does)."""


class _RawContext:
    """What ``ParameterServerService.Exchange`` needs of a grpc.aio ServicerContext."""

    def __init__(self, frames: FrameSocket, peer: str) -> None:
        self.frames = frames
        self._peer = peer

    async def read(self):
        frame = await self.frames.read(MAX_FRAME)
        if frame is None:
            return grpc.aio.EOF
        if frame[0]:
            raise BadRequest("a client sends no status frames")
        return frame[1]

    async def write(self, message: bytes) -> None:
        await self.frames.write(message)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        await self.frames.write(status_body(code.name, details), status=True)
        raise _Aborted(code.name)

    def peer(self) -> str:
        return self._peer


async def _handshake(frames: FrameSocket, token: bytes | None) -> bool:
    """The shard's side of the handshake (cgx_ps/net/raw_frames.py): does the worker prove ``token``?"""
    first = await frames.read(MAX_PREFACE)
    if first is None or first[0] or parse_preface(first[1]).problem:
        return False
    nonce = new_nonce()
    await frames.write(challenge(nonce))
    presented = await frames.read(MAX_PREFACE)
    if presented is None or presented[0] or parse_preface(presented[1]).problem:
        return False
    return token is None or presented_token(parse_preface(presented[1]).rest, nonce, token) == token


async def _serve_connection(service: ParameterServerService, token: bytes | None,
                            frames: FrameSocket, peer: str) -> None:
    context = _RawContext(frames, peer)
    try:
        try:
            if isinstance(frames, TlsFrameSocket):
                await asyncio.wait_for(frames.handshake(), FIRST_MESSAGE_TIMEOUT_S)
            proven = await asyncio.wait_for(_handshake(frames, token), FIRST_MESSAGE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise TimedOut(f"no token within {FIRST_MESSAGE_TIMEOUT_S:g}s of connecting") from None
        if not proven:
            raise Unauthenticated("missing or wrong job token")
        await service.Exchange(context)
    except ProtocolError as exc:  # as rpc.py's gate maps a refusal to a status
        try:
            await context.abort(*grpc_status(exc))
        except (_Aborted, OSError, ssl.SSLError):
            pass
    except (_Aborted, OSError, ssl.SSLError):
        pass  # the handler's own status went out, or the client is gone (or failed the handshake)
    finally:
        frames.close()


async def serve_raw(service: ParameterServerService, token: bytes | None, host: str,
                    tls: ssl.SSLContext | None = None, io: str = "sock") -> tuple[int, asyncio.Task]:
    """Listen on ``host``, a free port; (the port, the task serving it: cancel it to stop).
    ``io``: "sock" (FrameSocket, or TlsFrameSocket with ``tls``) or "protocol" (the shipped
    listener, server/rpc/raw_listener.py; plaintext only)."""
    if io == "protocol":
        if tls is not None:
            raise ValueError("the protocol variant is plaintext only")
        return await _serve_protocol(service, token, host)
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
                frames = FrameSocket(sock) if tls is None else TlsFrameSocket(sock, tls, server_side=True)
                task = asyncio.create_task(_serve_connection(service, token, frames, f"ipv4:{addr[0]}:{addr[1]}"))
                connections.add(task)
                task.add_done_callback(connections.discard)
        finally:
            listener.close()
            for task in connections:
                task.cancel()

    return listener.getsockname()[1], asyncio.create_task(accept())


async def _serve_protocol(service: ParameterServerService, token: bytes | None, host: str
                          ) -> tuple[int, asyncio.Task]:
    """The shipped listener (its gate, cap, timeouts) on a free port; cancel the task to close it."""
    plane = DataPlane(service, Gate(service, token), max_connections=1024)
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

class RawCall:
    """One Exchange stream over a raw connection, an ExchangeCall (cgx_ps/worker/shards/exchange_call.py)
    as the shipped plane's: ``write``, ``cancel`` and async iteration over the read results, ending
    with StreamEnded carrying the shard's status (as gRPC's trailers would), UNAVAILABLE when the
    connection breaks."""

    plane = "raw"

    def __init__(self, frames: FrameSocket) -> None:
        self.frames = frames

    @classmethod
    async def open(cls, host: str, port: int, token: bytes, tls: ssl.SSLContext | None = None) -> "RawCall":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
            if tls is None:
                frames = FrameSocket(sock)
            else:
                frames = TlsFrameSocket(sock, tls, server_side=False, server_hostname=host)
                await frames.handshake()
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            raise StreamEnded("UNAVAILABLE", f"raw data plane {host}:{port}: {exc}") from None
        call = cls(frames)
        try:  # the handshake (cgx_ps/net/raw_frames.py): the opening, the shard's challenge, the proof
            await frames.write(opening())
            answer = await frames.read(MAX_CHALLENGE)
            nonce = parse_challenge(answer[1]).nonce if answer is not None and not answer[0] else b""
            if not nonce:
                raise ConnectionResetError(f"no challenge from the shard: {answer!r:.200}")
            await frames.write(preface(proof(token, nonce)))
        except (OSError, ssl.SSLError) as exc:
            frames.close()
            raise StreamEnded("UNAVAILABLE", f"raw data plane {host}:{port}: {exc}") from None
        return call

    async def write(self, frame: bytes | memoryview) -> None:
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
            while (frame := await self.frames.read(MAX_FRAME)) is not None:
                status, body = frame
                if status:
                    name, details = parse_status(body)
                    if name == "OK":  # the shipped listener's clean end
                        return
                    raise StreamEnded(name if name in grpc.StatusCode.__members__ else "UNKNOWN", details)
                yield read_result(body)
        except (OSError, ssl.SSLError, BadRequest) as exc:
            raise StreamEnded("UNAVAILABLE", f"stream broke: {exc}") from None


class _RawPlaneConnection(ShardConnection):
    """ShardConnection (Register and everything else over gRPC) whose Exchange streams go over
    the raw data plane at ``raw_port``, with the gRPC channel's TLS settings (``tls``)."""

    raw_port = 0
    token = b""  # the job token the gRPC calls carry in their metadata
    tls: ssl.SSLContext | None = None

    async def open_exchange(self) -> RawCall:
        return await RawCall.open(self.address.rsplit(":", 1)[0], self.raw_port, self.token, self.tls)


class RawShardClient(ShardClient):
    """ShardClient (its pushes, results, recovery and futures unchanged) whose Exchange streams go
    over the raw data plane at ``raw_port``."""

    connection_type = _RawPlaneConnection

    def __init__(self, *args, raw_port: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.connection.raw_port = raw_port
        meta = dict(self.connection.metadata)
        self.connection.token = meta["authorization"][len("Bearer "):].encode() if "authorization" in meta else b""
        sec = self.connection.security
        if sec.tls_ca:  # the gRPC channel's settings (security.py): the CA, a client certificate
            self.connection.tls = ssl.create_default_context(cafile=sec.tls_ca)
            if sec.tls_cert:
                self.connection.tls.load_cert_chain(sec.tls_cert, sec.tls_key)


if __name__ == "__main__":
    import uvloop

    sys.exit(uvloop.run(_serve(sys.argv[1:])))
