"""Mutations of valid messages and of their order in a stream, and garbage bytes."""

from __future__ import annotations

import random

from .settings import MAX_MESSAGE
from .values import log_uniform

INTERESTING_BYTES = [b"\x00", b"\xff", b"\x80" * 10, b"\xff" * 9 + b"\x01", b"\x0a\xff\xff\xff\xff\x0f",
                     b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", b"\x0b", b"\x0c", b"\x7f"]


def _flip_bits(rng: random.Random, b: bytearray) -> bytearray:
    for _ in range(rng.randint(1, 8) if b else 0):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return b


def _truncate(rng: random.Random, b: bytearray) -> bytearray:
    return b[:rng.randrange(len(b) + 1)]


def _insert(rng: random.Random, b: bytearray) -> bytearray:
    at = rng.randrange(len(b) + 1)
    b[at:at] = rng.choice(INTERESTING_BYTES) if rng.random() < 0.5 else rng.randbytes(rng.randint(1, 32))
    return b


def _duplicate(rng: random.Random, b: bytearray) -> bytearray:
    if not b:
        return b
    i = rng.randrange(len(b))
    j = rng.randrange(i, len(b) + 1)
    at = rng.randrange(len(b) + 1)
    b[at:at] = b[i:j] * rng.choice((1, 2, 8))
    return b


def _delete(rng: random.Random, b: bytearray) -> bytearray:
    if b:
        i = rng.randrange(len(b))
        del b[i:i + rng.randint(1, 16)]
    return b


def _overwrite(rng: random.Random, b: bytearray) -> bytearray:
    for _ in range(rng.randint(1, 4) if b else 0):
        b[rng.randrange(len(b))] = rng.choice((0x00, 0x01, 0x7F, 0x80, 0xFF, rng.randrange(256)))
    return b


BYTE_MUTATIONS = (_flip_bits, _truncate, _insert, _duplicate, _delete, _overwrite)


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        b = rng.choice(BYTE_MUTATIONS)(rng, b)
    return bytes(b)


def mutate_sequence(rng: random.Random, messages: list[bytes]) -> list[bytes]:
    """Mutate some messages of a stream, and sometimes the stream itself (drop, repeat, swap)."""
    out = [mutate_bytes(rng, m) if rng.random() < 0.5 else m for m in messages]
    if out and all(a == b for a, b in zip(out, messages)):
        i = rng.randrange(len(out))
        out[i] = mutate_bytes(rng, out[i])
    if len(out) > 1 and rng.random() < 0.3:
        i, j = rng.randrange(len(out)), rng.randrange(len(out))
        action = rng.choice(("drop", "repeat", "swap"))
        if action == "drop":
            del out[i]
        elif action == "repeat":
            out.insert(j, out[i])
        else:
            out[i], out[j] = out[j], out[i]
    return out


def garbage(rng: random.Random) -> bytes:
    r = rng.random()
    if r < 0.5:
        return rng.randbytes(log_uniform(rng, 4096))
    if r < 0.8:  # protobuf-looking: tags of every wire type followed by arbitrary bytes
        return b"".join(bytes([rng.randrange(256)]) + rng.choice(INTERESTING_BYTES) for _ in range(rng.randint(1, 32)))
    if r < 0.98:
        return rng.randbytes(log_uniform(rng, 1 << 20))
    return rng.randbytes(MAX_MESSAGE + rng.randrange(1, 1 << 20))  # over the shard's message limit
