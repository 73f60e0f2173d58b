"""The Exchange stream's bulk messages in raw bytes: a pushed chunk read without a protobuf copy,
a result chunk framed once for every node.

The gRPC handlers take and give raw bytes (rpc.py), so the shard decides how its hottest
messages are (de)serialized. With protobuf objects a pushed chunk's data was copied three times
after gRPC's own copy (parse, and each read of ``chunk.data``), and a result was serialized once
per node; profiles of benchmarks/server.py put these copies at about a quarter of the event
loop's time (BENCHMARKS.md, "Where the shard's time goes").

``read_push`` accepts only the shape our clients send (an ExchangeRequest holding one PushChunk,
each field at most once with its declared wire type) and returns the chunk's data as a view into
the received bytes. Anything else (a Hello, unknown or repeated fields, truncation, a varint of
more than 10 bytes) goes to the protobuf parser, whose answer, or refusal, stands: the fast path
never accepts a message that protobuf would read differently (tests/test_frames.py checks this
on arbitrary bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..chunkframes import PULL_FIELD, chunk_frames
from ..v1 import ps_pb2
from .errors import BadRequest
from .rpc import parse_message

__all__ = ["PushFrame", "read_push", "result_frames"]

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
_VARINT = 0
_LEN = 2


@dataclass(frozen=True, slots=True)
class PushFrame:
    """One pushed chunk (the fields of ps_pb2.PushChunk); ``data`` may view the received bytes."""

    round: int
    block_id: int
    total_bytes: int
    offset: int
    data: bytes | memoryview
    restore: bool = False  # a recovering node's last result for a resumed session (ps.proto)


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """(value, next position) of the varint at ``pos``, or None if it is cut off or too long."""
    value = shift = 0
    for i in range(pos, min(end, pos + 10)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (value, i + 1) if value <= _U64 else None  # past 64 bits: protobuf decides
        shift += 7
    return None


# PushChunk field number -> (attribute, mask); field 5 is the data, field 6 the restore flag (a bool:
# any non-zero varint is true, as protobuf reads it)
_PUSH_INTS = {1: ("round", _U64), 2: ("block_id", _U32), 3: ("total_bytes", _U64), 4: ("offset", _U64),
              6: ("restore", _U64)}
_LAST_FIELD = 6


def _fast_push(raw: bytes) -> PushFrame | None:
    """The push in ``raw`` if it has the plain shape, else None (the caller parses it fully)."""
    if len(raw) < 2 or raw[0] != (2 << 3 | _LEN):  # field 2 (push), length-delimited
        return None
    length = _varint(raw, 1, len(raw))
    if length is None or length[1] + length[0] != len(raw):
        return None
    pos, end = length[1], len(raw)
    fields: dict[str, int] = {"round": 0, "block_id": 0, "total_bytes": 0, "offset": 0, "restore": 0}
    seen = 0
    data: bytes | memoryview = b""
    while pos < end:
        tag = raw[pos]  # every PushChunk tag is one byte; a longer one is for protobuf
        pos += 1
        number, wire_type = tag >> 3, tag & 7
        if tag >= 0x80 or not 1 <= number <= _LAST_FIELD or seen & (1 << number):
            return None  # unknown or repeated field: protobuf's rules decide
        seen |= 1 << number
        if number == 5:
            if wire_type != _LEN:
                return None
            size = _varint(raw, pos, end)
            if size is None or size[1] + size[0] > end:
                return None
            pos = size[1] + size[0]
            data = memoryview(raw)[size[1]:pos]
        else:
            if wire_type != _VARINT:
                return None
            value = _varint(raw, pos, end)
            if value is None:
                return None
            name, mask = _PUSH_INTS[number]
            fields[name] = value[0] & mask
            pos = value[1]
    restore = fields.pop("restore") != 0
    return PushFrame(data=data, restore=restore, **fields)


def read_push(raw: bytes) -> PushFrame:
    """The PushChunk of an ExchangeRequest after the Hello; BadRequest for a malformed message
    or one that is not a push."""
    frame = _fast_push(raw)
    if frame is not None:
        return frame
    request = parse_message(ps_pb2.ExchangeRequest, raw)
    if request.WhichOneof("kind") != "push":
        raise BadRequest("expected a PushChunk after Hello")
    c = request.push
    return PushFrame(c.round, c.block_id, c.total_bytes, c.offset, c.data, c.restore)


def result_frames(block_id: int, round_: int, data: bytes) -> list[bytes]:
    """A result as serialized ExchangeResponse PullChunks of at most CHUNK_BYTES of data, built
    once and written as they are to every node's stream; at least one (so an empty result still
    tells its total_bytes)."""
    return chunk_frames(PULL_FIELD, block_id, round_, data)
