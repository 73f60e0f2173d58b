"""Hostile field values: edge and random integers, doubles (NaN payloads included), odd and
huge strings and bytes."""

from __future__ import annotations

import math
import random
import string
import struct

from google.protobuf.descriptor import FieldDescriptor

from .settings import CAPACITY

U32, U64 = (1 << 32) - 1, (1 << 64) - 1
INT_RANGES = {"uint32": (0, U32), "uint64": (0, U64), "int32": (-(1 << 31), (1 << 31) - 1),
              "int64": (-(1 << 63), (1 << 63) - 1)}
EDGE_INTS = {
    "uint32": [0, 1, 2, 7, 8, 255, 256, 1 << 16, (1 << 24) + 8, (1 << 31) - 1, 1 << 31, U32],
    "uint64": [0, 1, 2, 31, 32, 1 << 20, CAPACITY, CAPACITY + 1, U32, 1 << 32, (1 << 53) + 1, (1 << 63) - 1,
               1 << 63, U64],
    "int32": [0, 1, -1, 5, 99, -(1 << 31), (1 << 31) - 1],
    "int64": [0, 1, -1, -64, 1 << 40, -(1 << 63), (1 << 63) - 1],
}
EDGE_DOUBLES = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, -5e-324, 1e-9, 1e-3, 0.5, 60.0,
                3600.0, math.nextafter(3600.0, math.inf), 1e308, -1e308, -1.0]
ODD_TEXT = ["", "\x00", "fuzz-node", "node-0", "%s%n%x{0}{}", "' OR 1=1 --", "\u202e\u0301\u200b", "\U0001f980" * 3,
            "\ud7ff\ue000\uffff", "\n\r\t", "../../etc/passwd", "a" * 256, "a" * 257, "é" * 129, "blob/0"]
SCALAR_KINDS = {FieldDescriptor.TYPE_UINT32: "uint32", FieldDescriptor.TYPE_UINT64: "uint64",
                FieldDescriptor.TYPE_INT32: "int32", FieldDescriptor.TYPE_INT64: "int64",
                FieldDescriptor.TYPE_ENUM: "int32"}  # proto3 enums are open: any int32 parses


def log_uniform(rng: random.Random, top: int) -> int:
    """A length or size in 0..top, small ones as likely as large ones per order of magnitude."""
    return min(top, int(2 ** rng.uniform(0, math.log2(top + 1))) - 1 + rng.randrange(2))


def pick_int(rng: random.Random, kind: str) -> int:
    if rng.random() < 0.6:
        return rng.choice(EDGE_INTS[kind])
    lo, hi = INT_RANGES[kind]
    value = rng.getrandbits(rng.randrange(1, hi.bit_length() + 1))
    return max(lo, min(hi, -value if lo < 0 and rng.random() < 0.5 else value))


def pick_double(rng: random.Random) -> float:
    r = rng.random()
    if r < 0.6:
        return rng.choice(EDGE_DOUBLES)
    if r < 0.8:
        return struct.unpack("<d", rng.randbytes(8))[0]  # any bit pattern, NaN payloads included
    return rng.uniform(-10.0, 10.0)


def random_code_point(rng: random.Random) -> str:
    while True:
        c = rng.randrange(0x110000)
        if not 0xD800 <= c <= 0xDFFF:  # lone surrogates cannot be set on a proto string
            return chr(c)


def pick_text(rng: random.Random, top: int = 4096) -> str:
    r = rng.random()
    if r < 0.35:
        return rng.choice(ODD_TEXT)
    if r < 0.37:  # huge: status messages and log lines must not echo it
        return "x" * rng.randrange(20_000, 1_000_000)
    n = log_uniform(rng, top)
    if r < 0.7:
        return "".join(rng.choices(string.printable, k=n))
    return "".join(random_code_point(rng) for _ in range(min(n, 2048)))


def pick_bytes(rng: random.Random, top: int = 1 << 16) -> bytes:
    r = rng.random()
    if r < 0.02:
        return rng.randbytes(rng.randrange(1 << 20, 4 << 20))
    if r < 0.1:
        return bytes([rng.choice((0, 0x80, 0xFF))]) * log_uniform(rng, top)
    return rng.randbytes(log_uniform(rng, top))
