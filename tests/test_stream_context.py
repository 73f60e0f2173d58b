"""The shard's StreamContext (server/rpc/stream_context.py) is one contract on both planes: what
the service reads, writes, aborts with and learns of its client is the same whether the stream
came to the gRPC port (GrpcContext over grpc.aio's ServicerContext) or to the raw data plane
(RawContext over a FrameConnection). The contract is a mixin; each plane's subclass serves a probe
service behind the shipped gate (add_parameter_server, or DataPlane) on port 0 and speaks to it as
that plane's clients do, over real sockets: a grpc.aio call, or the framing's handshake and frames.

- read gives the client's messages in order (a large one whole), then EOF at its half-close;
  write reaches the client in order, bytes or a protobuf message; the stream then ends OK;
- abort(code, details) ends the stream with that status after what was written, and raises what
  the gate passes on (nothing after it runs); a refusal the service raises is mapped alike;
- peer() names the client's own address and port, as gRPC names it;
- a wrong job token is refused UNAUTHENTICATED before the service runs, naming how the plane
  presents the token (``token_presented_as``);
- a client that goes away cancels its handler (a read under way may return EOF first);
- ``plane`` says which it is (the metrics' per-plane stream gauge reads it).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
import pytest

from cgx_ps.net.raw_frames import frame_header, opening, parse_challenge, parse_status, preface, proof, split_header
from cgx_ps.net.security import read_token
from cgx_ps.server.rpc.gate import SERVICE_NAME, Gate, add_parameter_server
from cgx_ps.server.rpc.raw_listener import DataPlane
from cgx_ps.server.rpc.stream_context import EOF, StreamEnded
from cgx_ps.server.errors import BadRequest
from cgx_ps.v1 import ps_pb2
from support import TOKEN_FILE

TOKEN = read_token(TOKEN_FILE).encode()
WRONG = b"not-the-job-token-0123456789"
Script = Callable[[Any, dict], Awaitable[None]]


class Probe:
    """A service whose Exchange runs the test's ``script`` on the context it is handed; what the
    script records lands in ``seen``, and ``done`` is set when the handler returns or raises."""

    draining = False

    def __init__(self) -> None:
        self.script: Script | None = None
        self.seen: dict[str, Any] = {}
        self.done = asyncio.Event()
        self.ran = False

    async def Exchange(self, context: Any) -> None:  # noqa: N802
        self.ran = True
        try:
            await self.script(context, self.seen)
        finally:
            self.done.set()


class GrpcClient:
    """An Exchange call on the gRPC port, raw bytes each way, as a worker's ShardClient makes it."""

    def __init__(self, channel: grpc.aio.Channel, token: bytes) -> None:
        self.call = channel.stream_stream(f"/{SERVICE_NAME}/Exchange")(
            metadata=(("authorization", "Bearer " + token.decode()),))

    async def send(self, message: bytes) -> None:
        try:
            await self.call.write(message)
        except grpc.aio.AioRpcError:
            pass  # the call ended before the write (a refusal can beat it): ending() says how

    async def close_sending(self) -> None:
        await self.call.done_writing()

    async def receive(self) -> bytes | None:
        try:
            message = await self.call.read()
        except grpc.aio.AioRpcError:
            return None  # the status says why (ending)
        return None if message is EOF else message

    async def ending(self) -> tuple[str, str]:
        return (await self.call.code()).name, await self.call.details()

    def go_away(self) -> None:
        self.call.cancel()


class RawClient:
    """A data plane connection past the handshake, its frames written and read by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._ending: tuple[str, str] | None = None

    @classmethod
    async def open(cls, port: int, token: bytes) -> "RawClient":
        client = cls(*await asyncio.open_connection("127.0.0.1", port))
        await client.send(opening())
        challenge = await client._frame()
        await client.send(preface(proof(token, parse_challenge(challenge[1]).nonce)))
        return client

    async def _frame(self) -> tuple[bool, bytes]:
        size, status = split_header(await self.reader.readexactly(4))
        return status, await self.reader.readexactly(size)

    async def send(self, message: bytes) -> None:
        self.writer.write(frame_header(len(message)) + message)
        await self.writer.drain()

    async def close_sending(self) -> None:
        self.writer.write_eof()

    async def receive(self) -> bytes | None:
        status, body = await self._frame()
        if status:
            self._ending = parse_status(body)
            return None
        return body

    async def ending(self) -> tuple[str, str]:
        while self._ending is None:
            await self.receive()
        return self._ending

    def go_away(self) -> None:
        # a reset, as a peer that vanished leaves it (a FIN would be a half-close: EOF, not gone)
        self.writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


def client_ports(server_port: int) -> set[int]:
    """The local ports of this host's established connections to ``server_port`` (the clients')."""
    ports = set()
    for table in ("tcp", "tcp6"):  # gRPC's sockets are IPv6 ones, 127.0.0.1 mapped into them
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == server_port and fields[3] == "01":
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


async def until(event: asyncio.Event, timeout_s: float = 10.0) -> None:
    await asyncio.wait_for(event.wait(), timeout_s)


class StreamContextContract:
    """The contract; a subclass per plane provides ``plane`` and the ``endpoint`` fixture:
    (the Probe its server serves, its port, ``connect(token)`` giving a client)."""

    plane: str

    async def test_read_gives_the_messages_in_order_then_eof_and_write_reaches_the_client(self, endpoint) -> None:
        probe, _, connect = endpoint
        large = bytes(range(256)) * (4 << 12)  # 4 MiB: the raw plane receives it in place, as a buffer

        async def script(context, seen) -> None:
            messages = []
            while (message := await context.read()) is not EOF:
                messages.append(bytes(message))
            seen["messages"] = messages
            for message in reversed(messages[:2]):
                await context.write(message)
            await context.write(ps_pb2.StatusRequest())  # a protobuf message, serialized on the way
            await context.write(ps_pb2.RoundError(block_id=7, message="late"))

        probe.script = script
        client = await connect(TOKEN)
        for message in (b"first", b"second", large):
            await client.send(message)
        await client.close_sending()
        received = [await client.receive() for _ in range(4)]
        assert received == [b"second", b"first", b"", ps_pb2.RoundError(block_id=7, message="late").SerializeToString()]
        assert await client.receive() is None and await client.ending() == ("OK", "")
        assert probe.seen["messages"] == [b"first", b"second", large]

    async def test_abort_ends_the_stream_with_its_status_after_what_was_written(self, endpoint) -> None:
        probe, _, connect = endpoint

        async def script(context, seen) -> None:
            await context.read()
            await context.write(b"before")
            try:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "node 'x' has not registered")
            except BaseException as exc:
                seen["raised"] = exc
                raise
            seen["after"] = True  # never: abort raises

        probe.script = script
        client = await connect(TOKEN)
        await client.send(b"hello")
        assert await client.receive() == b"before"
        assert await client.ending() == ("FAILED_PRECONDITION", "node 'x' has not registered")
        await until(probe.done)
        assert isinstance(probe.seen["raised"], (grpc.aio.AbortError, StreamEnded)) and "after" not in probe.seen

    async def test_a_refusal_the_service_raises_is_the_same_status(self, endpoint) -> None:
        probe, _, connect = endpoint

        async def script(context, seen) -> None:
            await context.read()
            raise BadRequest("the first message must be a Hello")

        probe.script = script
        client = await connect(TOKEN)
        await client.send(b"not a hello")
        assert await client.ending() == ("INVALID_ARGUMENT", "the first message must be a Hello")

    async def test_peer_names_the_clients_own_address_and_port(self, endpoint) -> None:
        probe, port, connect = endpoint

        named = asyncio.Event()

        async def script(context, seen) -> None:
            seen["peer"], seen["plane"] = context.peer(), context.plane
            named.set()
            while await context.read() is not EOF:
                pass

        probe.script = script
        client = await connect(TOKEN)
        await client.send(b"hello")
        await until(named)
        (local,) = client_ports(port)  # the one connection to this server, while it is open: the client's
        assert probe.seen["peer"] == f"ipv4:127.0.0.1:{local}"
        assert probe.seen["plane"] == self.plane
        await client.close_sending()
        assert await client.ending() == ("OK", "")

    async def test_a_wrong_token_is_refused_before_the_service_runs(self, endpoint) -> None:
        probe, _, connect = endpoint
        probe.script = lambda context, seen: asyncio.sleep(0)
        client = await connect(WRONG)
        await client.send(b"hello")
        code, details = await client.ending()
        presented = {"grpc": "authorization: Bearer ...", "raw": "the data plane handshake's proof of it"}[self.plane]
        assert (code, details) == ("UNAUTHENTICATED", f"missing or wrong job token ({presented})")
        assert not probe.ran

    async def test_a_client_that_goes_away_cancels_its_handler(self, endpoint) -> None:
        probe, _, connect = endpoint
        reading = asyncio.Event()

        async def script(context, seen) -> None:
            await context.read()
            reading.set()
            try:
                await context.read()  # cancelled here (raw), or EOF first (gRPC: its call is closed)
                await asyncio.sleep(60)  # the handler's other work, results to write: cut short
            except asyncio.CancelledError:
                seen["ended"] = "cancelled"
                raise

        probe.script = script
        client = await connect(TOKEN)
        await client.send(b"hello")
        await until(reading)
        client.go_away()
        await until(probe.done)
        assert probe.seen["ended"] == "cancelled"


class TestGrpcContext(StreamContextContract):
    plane = "grpc"

    @pytest.fixture
    async def endpoint(self):
        probe, server = Probe(), grpc.aio.server()
        add_parameter_server(server, probe, TOKEN)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

        async def connect(token: bytes) -> GrpcClient:
            return GrpcClient(channel, token)

        try:
            yield probe, port, connect
        finally:
            await channel.close()
            await server.stop(grace=None)


class TestRawContext(StreamContextContract):
    plane = "raw"

    @pytest.fixture
    async def endpoint(self):
        probe = Probe()
        listener = DataPlane(probe, Gate(probe, TOKEN), max_connections=8)
        port = await listener.start("127.0.0.1", 0)
        try:
            yield probe, port, lambda token: RawClient.open(port, token)
        finally:
            await listener.close(grace_s=0)
