"""A worker's side of the raw data plane (the shard's: server/rpc/raw_listener.py; the wire:
cgx_ps/net/raw_frames.py): which transport a shard's Exchange stream takes, and the stream itself.

* ``decide_dataplane``: the raw plane when the shard advertises a data port (RegisterResponse)
  and the worker does not use TLS (the plane is plaintext, and under TLS it saves nothing), else
  gRPC. A pure function of its inputs, as ``gpu_setup.decide_transport``.
* ``falls_back_to_grpc``: under auto, whether a data port that cannot be reached sends the
  stream to gRPC (the shard has just answered Register: the network's doing) or is the shard's
  failure (a stream that broke mid-run: recovery's), also a pure function.
* ``RawCall``: one Exchange stream over a data plane connection, shaped as the grpc.aio call
  ``ShardClient`` uses (``write``, ``cancel``, async iteration over the results). Its end is an
  ``AioRpcError`` with the shard's status, and a connection that breaks (reset, EOF without a
  status) is UNAVAILABLE, so recovery.py's decisions apply to it as they are.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc

from ...net.addresses import host_port
from ...net.raw_frames import (MAX_CHALLENGE, MAX_FRAME, Frame, FrameReader, FrameTooLarge, frame_header, opening,
                               parse_challenge, parse_status, preface, proof, set_stream_options)
from ..config import DATAPLANES, dataplane_problem
from ..errors import ConfigError

__all__ = ["DATAPLANES", "DataplaneChoice", "RawCall", "decide_dataplane", "falls_back_to_grpc"]

CONNECT_TIMEOUT_S = 5.0  # a data port that does not answer by then is unreachable (auto: gRPC instead)


@dataclass(frozen=True)
class DataplaneChoice:
    """How a shard's Exchange stream travels, and what to tell the user about it."""

    plane: str  # "grpc" or "raw"
    warning: str = ""  # one log line when the choice is not what might be expected


def decide_dataplane(requested: str, advertised_port: int, tls: bool, shard: str = "") -> DataplaneChoice:
    """The transport for the Exchange stream to ``shard``; ``requested``: CGX_PS_DATAPLANE,
    ``advertised_port``: the shard's RegisterResponse.data_port (0: none), ``tls``: this worker
    reaches the shards over TLS. Raises ConfigError where ``raw`` cannot be had."""
    problem = dataplane_problem(requested, tls)
    if problem is not None:
        raise ConfigError(f"{problem} (shard {shard})")
    if requested == "grpc":
        return DataplaneChoice("grpc")
    if requested == "raw" and not advertised_port:
        raise ConfigError(f"CGX_PS_DATAPLANE=raw, but shard {shard} advertises no data port: start it with "
                          f"--data-port (CGX_PS_DATA_PORT), or use CGX_PS_DATAPLANE=auto")
    if not advertised_port:
        return DataplaneChoice("grpc")
    if tls:
        return DataplaneChoice("grpc", f"shard {shard} advertises a plaintext data port, but this worker uses "
                                       f"TLS: its Exchange stream stays on gRPC")
    return DataplaneChoice("raw")


def falls_back_to_grpc(requested: str, just_registered: bool) -> bool:
    """Under CGX_PS_DATAPLANE=``requested``, does a raw data plane connection that failed send the
    stream to gRPC? Only under auto, and only right after the shard answered Register (a first
    connect, or a rejoin of a restarted shard, which may listen on a new port): a port that cannot
    be reached then is a firewall, a NetworkPolicy or a port-forward of the gRPC port alone. On a
    stream repaired without a new Register (the plane worked for this registration), it is the
    shard's failure, which recovery retries; under raw, it always is."""
    return requested == "auto" and just_registered


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _FrameSocket:
    """Frames on a non-blocking socket, through the running loop's sock_* calls."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._reader = FrameReader()
        self._busy = 0  # sends and receives under way: the socket is closed after the last of them
        self._shut = False

    def shut(self) -> None:
        """End the connection now. A send or receive waiting on the socket fails at once: the
        shutdown wakes it (closing the socket alone would leave it waiting forever on an fd the
        loop no longer polls, and a send holds the client's write lock). The socket is closed
        once none waits."""
        if self._shut:
            return
        self._shut = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more: nothing waits on it
        if not self._busy:
            self.sock.close()

    async def _io(self, operation: Any) -> Any:
        self._busy += 1
        try:
            return await operation
        finally:
            self._busy -= 1
            if self._shut and not self._busy:
                self.sock.close()

    async def read(self, limit: int = MAX_FRAME) -> Frame | None:
        """The next frame (the shared sans-IO reader's); None at EOF between frames."""
        reader = self._reader
        reader.limit = limit  # a shard sends none larger: refused on its header, before it is allocated
        while True:
            n = await self._io(self.loop.sock_recv_into(self.sock, reader.buffer()))
            if n == 0:
                if reader.started:
                    raise ConnectionResetError("connection closed inside a frame")
                return None
            try:
                frame = reader.advance(n)
            except FrameTooLarge as exc:
                raise ConnectionResetError(f"{exc}, from the shard") from None
            if frame is not None:
                return frame

    async def write(self, data: Any) -> None:
        view = memoryview(data)
        await self._io(self.loop.sock_sendall(self.sock, frame_header(view.nbytes)))
        await self._io(self.loop.sock_sendall(self.sock, view))  # the kernel copies it, Python does not


async def _connect(host: str, port: int) -> socket.socket:
    """A connected non-blocking socket to the first of ``host``'s addresses that answers, in the
    resolver's order, as gRPC's (and socket.create_connection) try them: a dual-stack name may
    list an address the shard does not listen on first. Raises the last address's OSError."""
    loop = asyncio.get_running_loop()
    error: OSError = OSError(f"{host} has no address")
    for family, kind, proto, _, address in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:  # the timeout's cancellation: the socket is not the caller's yet
            sock.close()
            raise
    raise error


def _connect_problem(error: OSError, timeout_s: float, connected: bool) -> str:
    """Why a data plane connection failed, as the one warning line says it: the timeout's own
    error has no message (the line read "data plane host:port: "). A port that never answers is
    what a firewall dropping its packets looks like; one that answers but sends no challenge in
    time (``connected``) is not a shard of this framing."""
    if isinstance(error, TimeoutError) and connected:
        return (f"no challenge within {timeout_s:g}s of connecting: not a cgx-ps shard of data plane version 2 "
                f"(a port-forward or proxy to another program?)")
    if isinstance(error, TimeoutError) and not str(error):
        return f"no answer within {timeout_s:g}s (packets to the port dropped: a firewall or NetworkPolicy?)"
    return str(error) or type(error).__name__


def _shard_status(body: bytes | memoryview) -> grpc.aio.AioRpcError:
    """A status frame as the error of a gRPC call that ended with it."""
    name, details = parse_status(body)
    code = grpc.StatusCode.__members__.get(name)
    if code is None:  # no status a shard writes: say what came, not an empty UNKNOWN
        code, details = grpc.StatusCode.UNKNOWN, f"malformed status from the shard: {name[:40]!r} {details}"
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class RawCall:
    """One Exchange stream over a data plane connection, as ShardClient uses a grpc.aio call."""

    def __init__(self, frames: _FrameSocket, read_message: Any) -> None:
        self._frames = frames
        self._read_message = read_message

    @classmethod
    async def open(cls, host: str, port: int, token: bytes, read_message: Any,
                   connect_timeout_s: float = CONNECT_TIMEOUT_S) -> "RawCall":
        """Connect and do the handshake (net/raw_frames.py): the opening, the shard's challenge, the
        preface with the proof of ``token``; ``read_message`` reads a result frame
        (client.read_result). Raises an UNAVAILABLE AioRpcError when the port cannot be reached,
        or what answers is no cgx-ps shard, within ``connect_timeout_s`` (a firewall that drops
        packets would hold a connect for minutes), before anything of the token is sent; the
        shard's own status when it refuses the opening (another framing version)."""
        where = f"data plane {host_port(host, port)}"
        sock, call = None, None
        try:
            async with asyncio.timeout(connect_timeout_s):
                sock = await _connect(host, port)
                set_stream_options(sock)
                call = cls(_FrameSocket(sock), read_message)
                await call._frames.write(opening())
                nonce = await call._challenge(where)
            await call._frames.write(preface(proof(token, nonce)))
        except (OSError, grpc.aio.AioRpcError) as exc:  # TimeoutError among the OSErrors
            if call is not None:
                call.cancel()
            elif sock is not None:
                sock.close()
            if isinstance(exc, grpc.aio.AioRpcError):
                raise
            raise _unavailable(f"{where}: {_connect_problem(exc, connect_timeout_s, call is not None)}") from None
        return call

    async def _challenge(self, where: str) -> bytes:
        """The shard's nonce. A status in its place (a shard of another framing version names
        both) is raised as the shard's; anything else that is not a challenge, as UNAVAILABLE:
        what answers on this port is not a cgx-ps shard."""
        try:
            frame = await self._frames.read(MAX_CHALLENGE)
        except ConnectionResetError as exc:
            raise _unavailable(f"{where}: not a cgx-ps shard's challenge: {exc}") from None
        if frame is None:
            raise _unavailable(f"{where}: the connection closed before the shard's challenge")
        status, body = frame
        if status:
            raise _shard_status(body)
        challenge = parse_challenge(body)
        if challenge.problem:
            raise _unavailable(f"{where}: {challenge.problem}")
        return challenge.nonce

    async def write(self, frame: Any) -> None:
        try:
            await self._frames.write(frame)
        except OSError as exc:
            raise _unavailable(f"data plane stream closed: {exc}") from None

    def cancel(self) -> None:
        """End the stream, as a grpc.aio call's cancel does: a write or read under way fails."""
        self._frames.shut()

    def _parsed(self, body: bytes | memoryview) -> Any:
        try:
            return self._read_message(body)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and kin: as a gRPC deserializer's failure
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       f"malformed message from the shard: {type(exc).__name__}") from None

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._results()

    async def _results(self) -> AsyncIterator[Any]:
        try:
            while (frame := await self._frames.read()) is not None:
                status, body = frame
                if not status:
                    yield self._parsed(body)
                    continue
                if parse_status(body)[0] == "OK":
                    return  # the stream's clean end, as a gRPC call's OK status
                raise _shard_status(body)
        except OSError as exc:
            raise _unavailable(f"data plane stream broke: {exc}") from None
        raise _unavailable("data plane connection closed without a status")  # the shard died or was cut off
