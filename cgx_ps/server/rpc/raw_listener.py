"""The raw data plane's listener: Exchange streams over plain TCP beside the gRPC port (opt-in:
``--data-port``, for trusted networks where the shard's CPU is the limit; off by default,
config.deployed_data_port; plaintext, authenticated by a proof of the job token, never with TLS).

Why: Python gRPC costs the shard about a quarter of its CPU per round and the workers about 40%
of theirs for pushes and results; a plain TCP stream read by an asyncio BufferedProtocol gets it
back (benchmarks/server.py measures it; docs/data-plane.md has the figures). Under TLS the crypto
dominates and gRPC is as fast, so TLS deployments keep gRPC.

Each connection is one Exchange stream (framing: cgx_ps/net/raw_frames.py), read by a
``FrameConnection`` (raw_connection.py). Its frames go into ``ParameterServerService.Exchange``
unchanged, through the plane's ``StreamContext`` (raw_stream.py, stream_context.py), and through
the same ``Gate.run`` as a gRPC call: the token check (``bearer_matches``), the error table, the
clipped details and the rate-limited refusal log are the gRPC port's own. The token never travels
on the plane (net/raw_frames.py: a worker proves it holds it, by an HMAC of a fresh nonce);
``raw_stream.presented_token`` turns the proof into what the gate checks, the job token when the
proof is right and nothing otherwise, so the gate alone decides, as for a gRPC call. What the
plane adds is what HTTP/2 and gRPC's server gave the gRPC port, against a hostile network:

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
import ipaddress
import socket

from ...net.addresses import host_port
from ..errors import LimitExceeded
from .gate import Gate
from .raw_connection import FrameConnection
from .raw_stream import serve_exchange
from .service import FIRST_MESSAGE_TIMEOUT_S, ParameterServerService

__all__ = ["DataPlane", "FRAME_TIMEOUT_S"]

FRAME_TIMEOUT_S = 30.0  # from a frame's first byte to its last: 8 MiB at under 300 kB/s is cut off


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
        self.connections: set[FrameConnection] = set()  # every connection open, pending or not
        self.pending: dict[FrameConnection, None] = {}  # those before their preface, oldest first
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
            return await loop.create_server(lambda: FrameConnection(self), sock=sock)
        return await loop.create_server(lambda: FrameConnection(self), host, port, reuse_port=False)

    def admit(self, connection: FrameConnection) -> bool:
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

    def promote(self, connection: FrameConnection) -> None:
        """A connection whose preface came: a stream now, if there is room under the cap."""
        self.pending.pop(connection, None)
        streams = len(self.connections) - len(self.pending) - 1  # the others past their preface
        if streams >= self.max_connections:
            raise LimitExceeded(f"{streams} data plane streams open (the cap, --max-concurrent-rpcs)")

    def forget(self, connection: FrameConnection) -> None:
        self.connections.discard(connection)
        self.pending.pop(connection, None)

    async def serve(self, connection: FrameConnection) -> None:
        """One connection: its handshake, then one Exchange stream through the gate (raw_stream.py),
        counted under the cap once the gate has passed its token."""
        try:
            await serve_exchange(connection, self.gate, self.first_frame_timeout_s, lambda: self.promote(connection))
        finally:
            connection.close(linger_s=self.frame_timeout_s)

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


def _serves_ipv4_too(host: str) -> bool:
    """Must a listener on ``host`` take IPv4 connections on an IPv6 socket? For "::" (every
    address), yes: gRPC's port on it does (IPV6_V6ONLY off), and asyncio's own listener would not
    (it sets IPV6_V6ONLY on every IPv6 socket), so a dual-stack shard's IPv4 workers would find
    its data port refused."""
    try:
        return ipaddress.ip_address(host) == ipaddress.IPv6Address("::") and socket.has_dualstack_ipv6()
    except ValueError:  # a name, not an address
        return False
