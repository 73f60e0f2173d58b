"""Frame-layer fuzzing of the raw data plane (server/rpc/raw_listener.py): hostile byte streams built from
a valid connection (the handshake, Hello, a push) by mutating the frames themselves (their length
words, the status bit, their bodies, how the bytes are split and where the stream stops), and
plain garbage. The service behind the frames is the one the gRPC fuzz covers: here the target
is what only the plane does.

    endings = await fuzz_frames("127.0.0.1", port, token, cases=200, seed=0)

Half the cases mutate the handshake itself (the opening, and a preface whose proof is random:
the shard's challenge comes between, and is not waited for); the others do the handshake right
first, with the token's proof of the shard's nonce, and mutate what follows.

Each case is one connection; its ending is the status frame it got ("CODE"), "closed" (no
status: the plane closed or reset it), "open" (nothing within ``deadline_s``: a hang) or
"handshake failed" (a right handshake was not answered: the shard is broken).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from cgx_ps.net.chunk_frames import PUSH_FIELD, chunk_frames
from cgx_ps.net.raw_frames import (MAX_FRAME, STATUS_BIT, frame_header, opening, parse_challenge, parse_status, preface,
                              proof, split_header)
from cgx_ps.v1 import ps_pb2

from .mutations import garbage, mutate_bytes

__all__ = ["FRAME_MUTATIONS", "fuzz_frames", "hostile_stream"]

FRAME_MUTATIONS = ("length", "status-bit", "body", "split", "cut", "garbage")


def _valid_bodies(rng: random.Random, handshake: bool) -> list[bytes]:
    """A connection's frames as a stranger would send them: a Hello of a node that never
    registered (so nothing reaches the members' session), a push; with ``handshake``, the
    opening and a preface (of a random proof) before them."""
    hello = ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id=f"fuzz-{rng.randrange(1 << 16)}",
                                                      session_id=rng.randbytes(16).hex())).SerializeToString()
    push = list(chunk_frames(PUSH_FIELD, 0, rng.randrange(4), rng.randbytes(rng.randint(1, 4096))))
    return [opening(), preface(rng.randbytes(32)), hello, *push] if handshake else [hello, *push]


def _length(rng: random.Random, size: int) -> int:
    return rng.choice((0, 1, size - 1, size + 1, size + rng.randint(2, 1 << 16), MAX_FRAME, MAX_FRAME + 1,
                       STATUS_BIT - 1, rng.randrange(1 << 31))) & (STATUS_BIT - 1)


def hostile_stream(rng: random.Random) -> tuple[str, list[bytes], bool, bool]:
    """(the mutation, the pieces to send in order, whether to stall after them instead of closing,
    whether to do the handshake right before sending them)."""
    kind = rng.choice(FRAME_MUTATIONS)
    if kind == "garbage":
        return kind, [garbage(rng)[:1 << 20]], rng.random() < 0.5, False
    proven = rng.random() < 0.5
    bodies = _valid_bodies(rng, handshake=not proven)
    at = rng.randrange(len(bodies))
    headers = [frame_header(len(b)) for b in bodies]
    if kind == "length":
        headers[at] = frame_header(_length(rng, len(bodies[at])))
    elif kind == "status-bit":
        headers[at] = frame_header(len(bodies[at]), status=True)
    elif kind == "body":
        bodies[at] = mutate_bytes(rng, bodies[at])
        headers[at] = frame_header(len(bodies[at]))
    data = b"".join(h + b for h, b in zip(headers, bodies))
    if kind == "cut":
        data = data[:rng.randrange(len(data))]
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 8)))) if len(data) > 1 else []
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    return kind, pieces, rng.random() < 0.5, proven


async def _prove(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: bytes) -> None:
    """The handshake, right: the opening, the shard's challenge, the proof of ``token``."""
    writer.write(frame_header(len(opening())) + opening())
    size, _ = split_header(await reader.readexactly(4))
    body = preface(proof(token, parse_challenge(await reader.readexactly(size)).nonce))
    writer.write(frame_header(len(body)) + body)


async def _one(host: str, port: int, pieces: list[bytes], stall: bool, deadline_s: float,
               token: bytes | None) -> str:
    """One case's ending; ``token``: do the handshake with it first (None: not)."""
    reader, writer = await asyncio.open_connection(host, port)
    if token is not None:
        try:
            await asyncio.wait_for(_prove(reader, writer, token), deadline_s)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            writer.close()
            return "handshake failed"

    async def send() -> None:
        try:
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.001)
            if not stall:
                writer.write_eof()
        except OSError:
            pass  # refused and closed before all of it went out

    async def ending() -> str:
        while True:
            header = await reader.readexactly(4)
            size, status = split_header(header)
            body = await reader.readexactly(size)
            if status:
                return parse_status(body)[0]

    sender = asyncio.create_task(send())
    try:
        return await asyncio.wait_for(ending(), deadline_s)
    except (asyncio.IncompleteReadError, ConnectionError):
        return "closed"
    except asyncio.TimeoutError:
        return "open"
    finally:
        sender.cancel()
        writer.close()


async def fuzz_frames(host: str, port: int, token: bytes, cases: int, seed: int = 0, concurrency: int = 16,
                      deadline_s: float = 5.0) -> Counter:
    """Endings of ``cases`` hostile connections, ``concurrency`` at a time; case ``i`` draws from
    ``random.Random(f"frames:{seed}:{i}")``."""
    endings: Counter = Counter()
    slots = asyncio.Semaphore(concurrency)

    async def case(i: int) -> None:
        kind, pieces, stall, proven = hostile_stream(random.Random(f"frames:{seed}:{i}"))
        async with slots:
            endings[(kind, await _one(host, port, pieces, stall, deadline_s, token if proven else None))] += 1

    await asyncio.gather(*(case(i) for i in range(cases)))
    return endings
