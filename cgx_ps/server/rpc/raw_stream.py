"""One Exchange stream on the raw data plane, over any frame transport (``FrameStream``): the
shard's side of the handshake, the stream's ``StreamContext``, and the stream served through the
gate (``serve_exchange``). The listener (raw_listener.py) drives it over its BufferedProtocol
(raw_connection.py); benchmarks/rawplane.py over its socket and TLS variants, so that what they
measure is this code.

The handshake (net/raw_frames.py): the worker's opening, a challenge of a fresh nonce, the
worker's preface with its proof of the job token. The proof becomes what the gate checks
(``presented_token``): the job token when it is right, nothing otherwise, so the gate alone
decides, as for a gRPC call, with its own error table, clipped details and refusal log.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, Callable, NoReturn, Protocol

import grpc

from ...net.raw_frames import (MAX_FRAME, MAX_HELLO, MAX_PREFACE, Frame, Preface, challenge, new_nonce, opening,
                               parse_preface, proof, status_body)
from ...net.security import AUTH_HEADER
from ..errors import BadRequest, ProtocolError, TimedOut
from .gate import Gate, clip, grpc_status
from .stream_context import EOF, StreamEnded

__all__ = ["FrameStream", "RawContext", "presented_token", "serve_exchange", "shard_handshake"]


class FrameStream(Protocol):
    """A connection's frames, as the shard reads and writes them."""

    peer: str  # the client, as gRPC names it (raw_connection.peer_name)

    async def read(self, limit: int) -> Frame | tuple[bool, Any] | None:
        """(is a status frame, body) of the next frame, refused over ``limit`` bytes (BadRequest);
        None at EOF between frames; a ConnectionError once the peer is gone."""

    async def write(self, data: Any, status: bool = False) -> None:
        """One frame; an OSError once the peer is gone."""


class RawContext:
    """``StreamContext`` of a data plane stream; ``token``: what its proof stands for
    (``presented_token``)."""

    plane = "raw"
    lost_as = "data plane connection"
    token_presented_as = "the data plane handshake's proof of it"

    def __init__(self, frames: FrameStream, token: bytes) -> None:
        self.frames = frames
        self._metadata = ((AUTH_HEADER, b"Bearer " + token),)  # what the gate checks: bearer_matches
        self.ended = False
        self._limit = MAX_HELLO  # until the Hello is read: Exchange reads on only once its session is proven

    def invocation_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._metadata

    def peer(self) -> str:
        return self.frames.peer

    async def read(self) -> Any:
        frame = await self.frames.read(self._limit)
        self._limit = MAX_FRAME
        if frame is None:
            return EOF
        if frame[0]:
            raise BadRequest("a client sends no status frames")
        return frame[1]

    async def write(self, message: Any) -> None:
        # results come serialized once for every node (bytes, or buffers), a RoundError as a message
        data = message.SerializeToString() if hasattr(message, "SerializeToString") else message
        try:
            await self.frames.write(data)
        except OSError:
            # the client is gone: end the handler quietly, as a gRPC write to a cancelled call does
            # (an OSError would reach the gate as an unexpected error, logged as one)
            raise StreamEnded("the client is gone") from None

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        try:
            await self.end(code, details)
        except OSError:
            pass  # the client is gone: there is no one left to tell (the gate would log it as unexpected)
        raise StreamEnded(code.name)

    async def end(self, code: grpc.StatusCode, details: str = "") -> None:
        """The stream's status frame, once (``OK`` for a clean end)."""
        if not self.ended:
            self.ended = True
            await self.frames.write(status_body(code.name, clip(details)), status=True)


async def serve_exchange(frames: FrameStream, gate: Gate, first_frame_timeout_s: float,
                         on_proven: Callable[[], None] = lambda: None) -> None:
    """One connection's Exchange stream: the handshake within ``first_frame_timeout_s``, then the
    service's Exchange through ``gate.run``, then its status frame. ``on_proven`` runs once the
    gate has passed the token, before the stream is served (the listener's cap on streams: it
    raises LimitExceeded), so a client without the token is told UNAUTHENTICATED, never how
    full the cap is. Returns when the stream has ended, its status sent or its peer gone."""
    try:
        try:
            token = await asyncio.wait_for(shard_handshake(frames, gate.token), first_frame_timeout_s)
        except asyncio.TimeoutError:
            raise TimedOut(f"no preface within {first_frame_timeout_s:g}s of connecting") from None
        context = RawContext(frames, token)

        async def stream() -> None:
            on_proven()
            await gate.service.Exchange(context)

        await gate.run("Exchange", context, stream)
        await context.end(grpc.StatusCode.OK)
    except ProtocolError as exc:  # the preface's refusals (the gate maps everything after it, the cap too)
        gate.log.warning("refused:dataplane", "data plane connection from %s refused: %s", frames.peer, exc.message)
        try:
            await RawContext(frames, b"").end(*grpc_status(exc))
        except OSError:
            pass
    except (StreamEnded, OSError):
        pass  # the stream's status went out, or the peer is gone


async def shard_handshake(frames: FrameStream, token: bytes | None) -> bytes:
    """The worker's opening, a challenge of a fresh nonce, the worker's preface: what its proof
    stands for at the gate (``presented_token``). Raises BadRequest for a frame that is not this
    framing's (a status naming both versions for another version's)."""
    first = await _handshake_frame(frames)
    if first.rest:  # a version 2 worker's opening is its magic and version alone
        raise BadRequest(f"an opening of {len(opening()) + len(first.rest)} bytes; a worker's has {len(opening())}")
    nonce = new_nonce()  # fresh per connection: a proof recorded on one is worth nothing on the next
    await frames.write(challenge(nonce))
    return presented_token((await _handshake_frame(frames)).rest, nonce, token)


async def _handshake_frame(frames: FrameStream) -> Preface:
    """A client's handshake frame, parsed (raw_frames.Preface); BadRequest for one that is not."""
    frame = await frames.read(MAX_PREFACE)
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
