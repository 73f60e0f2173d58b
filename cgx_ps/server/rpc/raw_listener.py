"""The raw data plane's listener: Exchange streams over plain TCP beside the gRPC port (an opt-in,
``--data-port``, for trusted networks where the shard's CPU is the limit; plaintext, authenticated
by a proof of the job token, never with TLS).

Why: Python gRPC costs the shard about a quarter of its CPU per round and the workers about 40%
of theirs for pushes and results; a plain TCP stream read by an asyncio BufferedProtocol gets it
back (benchmarks/dataplane.py; benchmarks/server.py --configs plain,raw). Under TLS the crypto
dominates and gRPC is as fast, so TLS deployments keep gRPC.

Each connection is one Exchange stream (framing: cgx_ps/net/raw_frames.py). Its frames go into
``ParameterServerService.Exchange`` unchanged, through a small context (read, write, abort), and
through the same ``Gate.run`` as a gRPC call: the token check (``bearer_matches``), the error
table, the clipped details and the rate-limited refusal log are the gRPC port's own. The token
never travels on the plane (net/raw_frames.py: a worker proves it holds it, by an HMAC of a fresh
nonce); ``presented_token`` turns the proof into what the gate checks, the job token when the
proof is right and nothing otherwise, so the gate alone decides, as for a gRPC call. What this
module adds is what HTTP/2 and gRPC's server gave the gRPC port, against a hostile network:

- the handshake (the worker's opening, the shard's challenge, the worker's preface with its
  proof) must be done within ``first_frame_timeout_s`` of connecting, and nothing else is read
  before the gate has passed the proof;
- a frame, once its first byte is in, must be whole within ``frame_timeout_s`` (a header
  trickled byte by byte is cut off, not held forever);
- a frame is refused on its header when it is over gRPC's message limit (the Hello, read before
  its session is proven, over ``MAX_HELLO``), before its body is allocated; reading pauses after
  each frame until the service asks for the next, so a stream holds at most one unread frame and
  the push budget's backpressure reaches TCP;
- at most ``max_connections`` streams (the gRPC port's --max-concurrent-rpcs: one past it is
  refused, RESOURCE_EXHAUSTED, as gRPC refuses a call past it; counted once the gate has passed
  the token, so a client without it is told UNAUTHENTICATED, not how full the cap is), and at most ``max_pending``
  connections that have not yet sent their preface (so before the token): one more closes the
  oldest of them. A client without the token cannot fill the cap members need (on the gRPC port
  it holds no call slot at all); to push an honest client out it must open ``max_pending``
  connections within the time that client takes to send its first frame;
- SO_KEEPALIVE with gRPC's keepalive timing, so a dead peer is noticed;
- a stream's status frame never waits for its peer to read, and a closed connection whose peer
  does not take its last bytes is aborted ``frame_timeout_s`` later (a client that acks a zero
  window would otherwise hold its handler, its unsent results and a place under the cap forever);
- a peer that goes away cancels its handler, as gRPC cancels a call whose client is gone.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
from typing import Any

import grpc

from ...net.addresses import host_port
from ...net.raw_frames import (MAX_FRAME, MAX_HELLO, MAX_PREFACE, Preface, challenge, new_nonce,
                               opening, parse_preface, proof, status_body)
from ...net.security import AUTH_HEADER
from ..errors import BadRequest, LimitExceeded, ProtocolError, TimedOut
from .gate import Gate, clip, grpc_status
from .raw_connection import Connection, peer_name
from .service import FIRST_MESSAGE_TIMEOUT_S, ParameterServerService

__all__ = ["DataPlane", "FRAME_TIMEOUT_S", "peer_name", "presented_token"]

FRAME_TIMEOUT_S = 30.0  # from a frame's first byte to its last: 8 MiB at under 300 kB/s is cut off


class _Aborted(grpc.aio.AbortError):
    """The stream ended with a status frame (grpc.aio's own abort raises AbortError: Gate.run
    passes it on)."""


class _PlaneContext:
    """What ``ParameterServerService.Exchange`` and ``Gate.run`` use of a grpc.aio
    ServicerContext, over one connection; ``token``: what its proof stands for (presented_token)."""

    # how this plane presents the job token, as the gate's refusal names it
    token_presented_as = "the data plane handshake's proof of it"

    def __init__(self, connection: Connection, token: bytes) -> None:
        self.connection = connection
        self._metadata = ((AUTH_HEADER, b"Bearer " + token),)  # what the gate checks: bearer_matches
        self.ended = False
        self._limit = MAX_HELLO  # until the Hello is read: Exchange reads on only once its session is proven

    def invocation_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._metadata

    def peer(self) -> str:
        return self.connection.peer

    async def read(self) -> Any:
        frame = await self.connection.read(self._limit)
        self._limit = MAX_FRAME
        if frame is None:
            return grpc.aio.EOF
        if frame[0]:
            raise BadRequest("a client sends no status frames")
        return frame[1]

    async def write(self, message: Any) -> None:
        # results come serialized once for every node (bytes, or buffers), a RoundError as a message
        data = message.SerializeToString() if hasattr(message, "SerializeToString") else message
        try:
            await self.connection.write(data)
        except OSError:
            # the client is gone: end the handler quietly, as a gRPC write to a cancelled call does
            # (an OSError would reach the gate as an unexpected error, logged as one)
            raise _Aborted() from None

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        try:
            await self.end(code, details)
        except OSError:
            pass  # the client is gone: there is no one left to tell (the gate would log it as unexpected)
        raise _Aborted()

    async def end(self, code: grpc.StatusCode, details: str = "") -> None:
        if not self.ended:
            self.ended = True
            await self.connection.write(status_body(code.name, clip(details)), status=True)


class DataPlane:
    """The listener: ``await start(host, port)``, then ``stop_accepting()`` and ``close()`` (what
    ShardServer.stop does around its drain)."""

    def __init__(self, service: ParameterServerService, gate: Gate, max_connections: int,
                 first_frame_timeout_s: float = FIRST_MESSAGE_TIMEOUT_S,
                 frame_timeout_s: float = FRAME_TIMEOUT_S, max_pending: int | None = None) -> None:
        self.service = service
        self.gate = gate
        self.max_connections = max_connections  # streams: connections past their preface
        # connections still to send their preface; as many as streams by default: a burst of every
        # worker reconnecting at once after a restart is accepted before any preface is read
        self.max_pending = max_connections if max_pending is None else max_pending
        self.first_frame_timeout_s = first_frame_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self.connections: set[Connection] = set()  # every connection open, pending or not
        self.pending: dict[Connection, None] = {}  # those before their preface, oldest first
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; the port bound (``port`` 0: a free one, the same on every address of ``host``)."""
        try:
            self._server = await self._listen(host, port)
            ports = [sock.getsockname()[1] for sock in self._server.sockets]
            if len(set(ports)) > 1:
                # port 0 on a name of several addresses (localhost: 127.0.0.1 and ::1): asyncio gives
                # each its own free port, and only one is advertised, so a worker reaching the name by
                # another address would be refused, or hand its token to whatever listens there.
                # gRPC's port is one port on all of them: so is this one.
                self._server.close()
                self._server = await self._listen(host, ports[0])
        except OSError as exc:
            raise OSError(f"cannot bind the data plane to {host_port(host, port)}: {exc.strerror}; choose another "
                          f"--data-port") from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _listen(self, host: str, port: int) -> asyncio.Server:
        loop = asyncio.get_running_loop()
        if _serves_ipv4_too(host):
            sock = socket.create_server((host, port), family=socket.AF_INET6, dualstack_ipv6=True)
            return await loop.create_server(lambda: Connection(self), sock=sock)
        return await loop.create_server(lambda: Connection(self), host, port, reuse_port=False)

    def admit(self, connection: Connection) -> bool:
        """A new connection, before a byte of it is read: it waits for its preface among the
        pending ones, the oldest of which makes way when they are ``max_pending``."""
        if self.max_pending <= 0:
            return False
        if len(self.pending) >= self.max_pending:
            oldest = next(iter(self.pending))
            self.gate.log.warning("refused:dataplane", "data plane connection from %s closed: no preface yet, and "
                                  "%d newer connections wait for theirs", oldest.peer, len(self.pending))
            self.forget(oldest)
            oldest.transport.abort()
        self.pending[connection] = None
        self.connections.add(connection)
        return True

    def promote(self, connection: Connection) -> None:
        """A connection whose preface came: a stream now, if there is room under the cap."""
        self.pending.pop(connection, None)
        streams = len(self.connections) - len(self.pending) - 1  # the others past their preface
        if streams >= self.max_connections:
            raise LimitExceeded(f"{streams} data plane streams open (the cap, --max-concurrent-rpcs)")

    def forget(self, connection: Connection) -> None:
        self.connections.discard(connection)
        self.pending.pop(connection, None)

    async def serve(self, connection: Connection) -> None:
        """One connection: its handshake, then one Exchange stream through the gate."""
        context: _PlaneContext | None = None
        try:
            try:
                token = await asyncio.wait_for(self._handshake(connection), self.first_frame_timeout_s)
            except asyncio.TimeoutError:
                raise TimedOut(f"no preface within {self.first_frame_timeout_s:g}s of connecting") from None
            context = _PlaneContext(connection, token)
            await self.gate.run("Exchange", context, lambda: self._stream(connection, context))
            await context.end(grpc.StatusCode.OK)
        except ProtocolError as exc:  # the preface's refusals (the gate maps everything after it, the cap too)
            self.gate.log.warning("refused:dataplane", "data plane connection from %s refused: %s", connection.peer,
                                  exc.message)
            await _quietly(_PlaneContext(connection, b"").end(*grpc_status(exc)))
        except (grpc.aio.AbortError, OSError):
            pass  # the stream's status went out, or the peer is gone
        finally:
            connection.close(linger_s=self.frame_timeout_s)

    async def _handshake(self, connection: Connection) -> bytes:
        """The worker's opening, a challenge of a fresh nonce, the worker's preface: what its
        proof stands for at the gate (presented_token). Raises BadRequest for a frame that is not
        this framing's (a status naming both versions for another version's)."""
        first = await _handshake_frame(connection)
        if first.rest:  # a version 2 worker's opening is its magic and version alone
            raise BadRequest(f"an opening of {len(opening()) + len(first.rest)} bytes; a worker's has {len(opening())}")
        nonce = new_nonce()  # fresh per connection: a proof recorded on one is worth nothing on the next
        await connection.write(challenge(nonce))
        return presented_token((await _handshake_frame(connection)).rest, nonce, self.gate.token)

    async def _stream(self, connection: Connection, context: _PlaneContext) -> None:
        """The Exchange stream, once the gate has passed the token: a client without it is told
        UNAUTHENTICATED, never how full the cap is, and holds no place under it."""
        self.promote(connection)
        await self.service.Exchange(context, plane="raw")

    def stop_accepting(self) -> None:
        """No new connections; those open go on (their rounds finish in the drain)."""
        if self._server is not None:
            self._server.close()

    async def close(self, grace_s: float = 1.0) -> None:
        """After the drain: give the handlers ``grace_s`` to send their statuses, then end them."""
        self.stop_accepting()
        tasks = {c.task for c in self.connections if c.task is not None}
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for connection in list(self.connections):
            if connection.task is not None:
                connection.task.cancel()
            if connection.transport is not None:
                connection.transport.abort()
        self.connections.clear()
        self.pending.clear()


async def _handshake_frame(connection: Connection) -> Preface:
    """A client's handshake frame, parsed (rawframes.Preface); BadRequest for one that is not."""
    frame = await connection.read(MAX_PREFACE)
    if frame is None or frame[0]:
        raise BadRequest("the connection ended before its preface" if frame is None else
                         "a client sends no status frames")
    parsed = parse_preface(frame[1])
    if parsed.problem:
        raise BadRequest(parsed.problem)
    return parsed


def presented_token(proof_: bytes, nonce: bytes, token: bytes | None) -> bytes:
    """What a connection's ``proof_`` presents to the gate, as a gRPC call's bearer token: the
    shard's ``token`` when the proof is right for ``nonce`` (constant time), else nothing, which
    the gate refuses as it refuses a missing token. A shard without a token checks none."""
    if token is None:
        return b""
    return token if hmac.compare_digest(proof_, proof(token, nonce)) else b""


def _serves_ipv4_too(host: str) -> bool:
    """Must a listener on ``host`` take IPv4 connections on an IPv6 socket? For "::" (every
    address), yes: gRPC's port on it does (IPV6_V6ONLY off), and asyncio's own listener would not
    (it sets IPV6_V6ONLY on every IPv6 socket), so a dual-stack shard's IPv4 workers would find
    its data port refused."""
    try:
        return ipaddress.ip_address(host) == ipaddress.IPv6Address("::") and socket.has_dualstack_ipv6()
    except ValueError:  # a name, not an address
        return False


async def _quietly(write: Any) -> None:
    try:
        await write
    except OSError:
        pass
