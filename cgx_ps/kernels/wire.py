"""The versioned, little-endian block wire format (docs/wire-format.md).

Every encoded block is ``header (32 bytes) | body``. The header is parsed and validated here,
before any kernel touches the body, so kernels can trust sizes and never read out of bounds.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

from .errors import CodecError

try:
    # ISA-L folds the CRC with carry-less multiplies: the same CRC-32 as zlib's, so the wire
    # format is unchanged, at 7.8 GB/s against zlib 1.2's 2.2 on a 2-core AMD EPYC. Every push
    # is checked and every result stamped with it, on both ends.
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a platform without an isal wheel: zlib's, the same values, slower
    from zlib import crc32 as _crc32

__all__ = [
    "Codec",
    "Header",
    "HEADER_SIZE",
    "WIRE_VERSION",
    "MAGIC",
    "FLAG_STOCHASTIC",
    "FLAG_NONFINITE",
    "body_size",
    "max_encoded_size",
    "num_buckets",
    "split_maxmin_body",
    "parse_header",
    "contributors_of",
    "set_contributors",
    "CONTRIBUTORS_OFFSET",
    "pack_header",
    "validate_settings",
]

MAGIC = b"CGXB"
WIRE_VERSION = 1
# magic, version, codec, bits, flags, numel, bucket_size, crc32(body), contributors, 4 reserved
# zero bytes
_HEADER = struct.Struct("<4sBBBBQIII4s")
# A shard's result of a quorum round (server/rounds/quorum.py) says what every node divides it
# by: the gradients pushed in time (late pushes carried into it come as corrections already
# weighted: server/rounds/late_rounds.py). 0: every node's, once (a push, and every result of a
# job without a quorum). Outside the crc, which covers the body.
CONTRIBUTORS_OFFSET = 24
HEADER_SIZE = _HEADER.size  # 32: keeps the float32 metadata that follows 8-byte aligned
FLAG_STOCHASTIC = 0x01
# The tensor held NaN/Inf (or values its codec cannot represent): the payload is the header
# alone and decodes as NaN everywhere. Mixed precision needs it: a loss scaler's overflow on
# one rank must reach every rank as non-finite, so every rank skips the same step.
FLAG_NONFINITE = 0x02
_KNOWN_FLAGS = FLAG_STOCHASTIC | FLAG_NONFINITE
_RESERVED = bytes(4)
MAX_CONTRIBUTORS = (1 << 32) - 1
MAX_BUCKET_SIZE = 1 << 24


class Codec(enum.IntEnum):
    """Codec ids: the byte in every header. Mirrors ``cgx_ps.v1.Codec`` (checked by tests)."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    MAXMIN = 4


_ELEMENT_BYTES = {Codec.FP32: 4, Codec.FP16: 2, Codec.BF16: 2}


@dataclass(frozen=True, slots=True)
class Header:
    codec: Codec
    bits: int
    flags: int
    numel: int
    bucket_size: int
    crc32: int
    contributors: int = 0  # what a shard's quorum round is divided by (CONTRIBUTORS_OFFSET); 0: every node's

    @property
    def stochastic(self) -> bool:
        return bool(self.flags & FLAG_STOCHASTIC)

    @property
    def non_finite(self) -> bool:
        return bool(self.flags & FLAG_NONFINITE)

    @property
    def body_size(self) -> int:
        if self.non_finite:
            return 0
        return body_size(self.codec, self.numel, self.bits, self.bucket_size)


def validate_settings(codec: Codec, bits: int, bucket_size: int) -> None:
    """Raise CodecError unless (codec, bits, bucket_size) is encodable."""
    if codec == Codec.MAXMIN:
        if not 1 <= bits <= 8:
            raise CodecError(f"bits must be in 1..8 for max-min quantization, got {bits}")
        # Multiples of 8 keep every bucket byte-aligned in the packed level stream, so buckets
        # can be encoded and decoded independently (one thread or CUDA block per bucket).
        if bucket_size < 8 or bucket_size % 8 or bucket_size > MAX_BUCKET_SIZE:
            raise CodecError(
                f"bucket_size must be a multiple of 8 in 8..{MAX_BUCKET_SIZE}, got {bucket_size}"
            )
    elif codec not in _ELEMENT_BYTES:
        raise CodecError(f"unknown codec id {int(codec)}")


def num_buckets(numel: int, bucket_size: int) -> int:
    return -(-numel // bucket_size)


def body_size(codec: Codec, numel: int, bits: int, bucket_size: int) -> int:
    if codec == Codec.MAXMIN:
        # (min, unit) float32 pairs per bucket, then levels packed LSB-first, `bits` per element
        return 8 * num_buckets(numel, bucket_size) + (numel * bits + 7) // 8
    return _ELEMENT_BYTES[codec] * numel


def max_encoded_size(numel: int) -> int:
    """The largest block of ``numel`` elements any codec writes, header included (fp32, or 8-bit
    max-min in the smallest buckets for a tiny block): the bound for a block whose settings a
    reader does not know yet."""
    return HEADER_SIZE + max(body_size(Codec.FP32, numel, 32, 8), body_size(Codec.MAXMIN, numel, 8, 8))


def split_maxmin_body(body: np.ndarray, numel: int, bucket_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A max-min body (uint8) as views of its two parts: the (min, unit) float32 pairs, one per
    bucket, and the packed levels."""
    nmeta = 2 * num_buckets(numel, bucket_size)
    return body[: 4 * nmeta].view(np.float32), body[4 * nmeta:]


def pack_header(header: Header) -> bytes:
    return _HEADER.pack(
        MAGIC, WIRE_VERSION, int(header.codec), header.bits, header.flags,
        header.numel, header.bucket_size, header.crc32, header.contributors, _RESERVED,
    )


def contributors_of(payload: bytes | bytearray | memoryview) -> int:
    """How many gradients a result sums (its header's contributors), 0 for every node's once;
    the payload's header must have been checked (``parse_header``)."""
    return int.from_bytes(memoryview(payload)[CONTRIBUTORS_OFFSET:CONTRIBUTORS_OFFSET + 4], "little")


def set_contributors(payload: memoryview, count: int) -> None:
    """Write into an encoded block's header how many gradients it sums (a quorum round's result)."""
    if not 0 <= count <= MAX_CONTRIBUTORS:
        raise CodecError(f"contributors must be in 0..{MAX_CONTRIBUTORS}, got {count}")
    payload[CONTRIBUTORS_OFFSET:CONTRIBUTORS_OFFSET + 4] = count.to_bytes(4, "little")


def parse_header(payload: bytes | bytearray | memoryview) -> Header:
    """Parse and validate a header; check the payload's length against it."""
    size = len(payload)
    if size < HEADER_SIZE:
        raise CodecError(f"payload truncated: {size} bytes, a block header alone is {HEADER_SIZE}")
    magic, version, codec_id, bits, flags, numel, bucket_size, crc, contributors, reserved = _HEADER.unpack_from(
        payload, 0
    )
    if magic != MAGIC:
        raise CodecError(f"not a cgx-ps block: magic {magic!r}, expected {MAGIC!r}")
    if version != WIRE_VERSION:
        raise CodecError(f"unsupported wire version {version} (this build reads {WIRE_VERSION})")
    try:
        codec = Codec(codec_id)
    except ValueError:
        raise CodecError(f"unknown codec id {codec_id}") from None
    if flags & ~_KNOWN_FLAGS:
        raise CodecError(f"unknown header flags 0x{flags:02x}")
    if reserved != _RESERVED:
        raise CodecError("reserved header bytes are not zero (corrupted header?)")
    if codec == Codec.MAXMIN:
        validate_settings(codec, bits, bucket_size)
    elif bits != 8 * _ELEMENT_BYTES[codec] or bucket_size != 0:
        # fixed by the codec: a stray value here must not pass as "another encoding"
        raise CodecError(f"{codec.name} header must say bits={8 * _ELEMENT_BYTES[codec]} bucket_size=0, "
                         f"got bits={bits} bucket_size={bucket_size}")
    header = Header(codec, bits, flags, numel, bucket_size, crc, contributors)
    expected = HEADER_SIZE + header.body_size
    if size != expected:
        kind = "truncated" if size < expected else "too long"
        raise CodecError(
            f"payload {kind}: {size} bytes, header declares {numel} elements "
            f"({codec.name}, bits={bits}, bucket_size={bucket_size}) = {expected} bytes"
        )
    return header


def body_crc32(payload: bytes | bytearray | memoryview) -> int:
    return _crc32(memoryview(payload)[HEADER_SIZE:])


def check_crc(payload: bytes | bytearray | memoryview, header: Header) -> None:
    actual = body_crc32(payload)
    if actual != header.crc32:
        raise CodecError(
            f"payload corrupted: body crc32 0x{actual:08x}, header says 0x{header.crc32:08x}"
        )
