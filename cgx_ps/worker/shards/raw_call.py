"""A worker's side of the raw data plane (the shard's: server/rpc/raw_listener.py; the wire:
cgx_ps/net/raw_frames.py): ``RawCall``, one Exchange stream over a data plane connection, an
``ExchangeCall`` (exchange_call.py) as the gRPC stream is. Which of the two a shard's stream
takes: dataplane.py.

A connection that breaks (a reset, EOF without a status) ends the stream with StreamEnded
UNAVAILABLE, as gRPC's transport does; the shard's status frame, with the shard's code.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, AsyncIterator, Callable

import grpc

from ...net.addresses import host_port
from ...net.raw_frames import (MAX_CHALLENGE, MAX_FRAME, Frame, FrameReader, FrameTooLarge, frame_header, opening,
                               parse_challenge, parse_status, preface, proof, receive_frame,
                               set_stream_options)
from ..errors import StreamEnded

__all__ = ["CONNECT_TIMEOUT_S", "RawCall"]

CONNECT_TIMEOUT_S = 5.0  # a data port that does not answer by then is unreachable (auto: gRPC instead)


class _FrameSocket:
    """Frames on a non-blocking socket, through the running loop's sock_* calls; received in
    place by the raw plane's one decoder (net/raw_frames.py's FrameReader), as the shard reads them."""

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
        """The next frame; None at EOF between frames. A frame over ``limit`` (a shard sends none)
        is refused on its header, before it is allocated."""
        self._reader.limit = limit
        try:
            return await receive_frame(self._reader, lambda view: self._io(self.loop.sock_recv_into(self.sock, view)))
        except FrameTooLarge as exc:
            raise ConnectionResetError(f"{exc}, from the shard") from None

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


def _shard_status(body: bytes | memoryview) -> StreamEnded:
    """A status frame as the end of the stream it ends."""
    name, details = parse_status(body)
    if name not in grpc.StatusCode.__members__:  # no status a shard writes: say what came, not an empty UNKNOWN
        name, details = "UNKNOWN", f"malformed status from the shard: {name[:40]!r} {details}"
    return StreamEnded(name, details)


class RawCall:
    """One Exchange stream over a data plane connection (an ExchangeCall: exchange_call.py)."""

    plane = "raw"

    def __init__(self, frames: _FrameSocket, read_message: Callable[[bytes | memoryview], Any]) -> None:
        self._frames = frames
        self._read_message = read_message
        self._end: tuple[str, str] | None = None  # how the stream ended, once it has: later writes raise it

    @classmethod
    async def open(cls, host: str, port: int, token: bytes, read_message: Callable[[bytes | memoryview], Any],
                   connect_timeout_s: float = CONNECT_TIMEOUT_S) -> "RawCall":
        """Connect and do the handshake (net/raw_frames.py): the opening, the shard's challenge, the
        preface with the proof of ``token``; ``read_message`` reads a result frame
        (exchange_call.read_result). Raises StreamEnded UNAVAILABLE when the port cannot be
        reached, or what answers is no cgx-ps shard, within ``connect_timeout_s`` (a firewall
        that drops packets would hold a connect for minutes), before anything of the token is
        sent; the shard's own status when it refuses the opening (another framing version)."""
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
        except (OSError, StreamEnded) as exc:  # TimeoutError among the OSErrors
            if call is not None:
                call.cancel()
            elif sock is not None:
                sock.close()
            if isinstance(exc, StreamEnded):
                raise
            raise StreamEnded("UNAVAILABLE", f"{where}: {_connect_problem(exc, connect_timeout_s, call is not None)}") \
                from None
        return call

    async def _challenge(self, where: str) -> bytes:
        """The shard's nonce. A status in its place (a shard of another framing version names
        both) is raised as the shard's; anything else that is not a challenge, as UNAVAILABLE:
        what answers on this port is not a cgx-ps shard."""
        try:
            frame = await self._frames.read(MAX_CHALLENGE)
        except ConnectionResetError as exc:
            raise StreamEnded("UNAVAILABLE", f"{where}: not a cgx-ps shard's challenge: {exc}") from None
        if frame is None:
            raise StreamEnded("UNAVAILABLE", f"{where}: the connection closed before the shard's challenge")
        if frame.status:
            raise _shard_status(frame.body)
        challenge = parse_challenge(frame.body)
        if challenge.problem:
            raise StreamEnded("UNAVAILABLE", f"{where}: {challenge.problem}")
        return challenge.nonce

    def _ended(self, code: str, details: str) -> StreamEnded:
        """The stream's end, kept for the writes after it; the first end stays (a cancel is not
        overwritten by the broken read it causes)."""
        if self._end is None:
            self._end = (code, details)
        return StreamEnded(*self._end)

    async def write(self, frame: bytes | memoryview) -> None:
        if self._end is not None:
            raise StreamEnded(*self._end)
        try:
            await self._frames.write(frame)
        except OSError as exc:
            raise self._ended("UNAVAILABLE", f"data plane stream closed: {exc}") from None

    def cancel(self) -> None:
        """End the stream, as a grpc.aio call's cancel does: a write or read under way fails."""
        self._ended("CANCELLED", "the worker cancelled the stream")
        self._frames.shut()

    def _parsed(self, body: bytes | memoryview) -> Any:
        try:
            return self._read_message(body)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and kin: nothing after it can be read
            ended = self._ended("INTERNAL", f"malformed message from the shard: {type(exc).__name__}")
            self._frames.shut()
            raise ended from None

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._results()

    async def _results(self) -> AsyncIterator[Any]:
        try:
            while (frame := await self._frames.read()) is not None:
                if not frame.status:
                    yield self._parsed(frame.body)
                    continue
                ended = _shard_status(frame.body)
                if ended.code == "OK":  # the stream's clean end, as a gRPC call's OK status
                    self._ended("UNAVAILABLE", "the shard ended the stream")
                    return
                raise self._ended(ended.code, ended.details)
        except OSError as exc:
            raise self._ended("UNAVAILABLE", f"data plane stream broke: {exc}") from None
        raise self._ended("UNAVAILABLE", "data plane connection closed without a status")  # the shard died or was cut off
