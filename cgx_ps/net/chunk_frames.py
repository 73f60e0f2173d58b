"""The Exchange stream's bulk chunks, serialized by hand: the bytes protobuf would write, built
with one copy of the data.

Both ends send a block as chunks of at most CHUNK_BYTES: a node pushes
``ExchangeRequest{push: PushChunk}``, a shard answers ``ExchangeResponse{pull: PullChunk}``. The
two chunk messages share fields 1-5 (round, block_id, total_bytes, offset, data); a push may add
field 6 (restore). Built through protobuf objects, each chunk's data was copied by the slicing,
by the nested message's constructor (a deep copy: ``ExchangeRequest(push=PushChunk(...))`` costs
about 0.25 ms per 0.5 MB chunk here, 4.5 ms of a worker's step for mlp17m) and by the
serializer. Here it is copied once, into the frame that gRPC sends as it is (the stream's
serializer passes bytes through).

``chunk_frames`` writes the fields in number order and leaves zeros out, as protobuf does, so the
bytes equal ``SerializeToString``'s (tests/test_frames.py checks both messages).

``read_chunk`` reads them back without protobuf's copies (a parse copies the data once, and
every read of ``chunk.data`` once more): the chunk's data is a view into the received bytes. The
shard reads pushes with it (server/rpc/push_frames.py), a worker its results (worker/shards/exchange_call.py). It
accepts only the shape our ends send (the outer message holding one chunk, each field at most
once with its declared wire type) and leaves anything else (another kind of message, unknown or
repeated fields, truncation, a varint of more than 10 bytes) to protobuf's parser, whose answer,
or refusal, stands: it never reads a message differently from protobuf (tests/test_frames.py
checks this on arbitrary bytes for both messages).
"""

from __future__ import annotations

from dataclasses import dataclass

from .channel_options import CHUNK_BYTES

__all__ = ["PULL_FIELD", "PUSH_FIELD", "ChunkFrame", "PushFrames", "chunk_frames", "encode_varint", "read_chunk"]

PUSH_FIELD = 2  # ExchangeRequest.push
PULL_FIELD = 1  # ExchangeResponse.pull
_VARINT = 0
_LEN = 2
_DATA = 5  # the chunk's data field; restore (a push's field 6) comes after it
_RESTORE_TRUE = bytes([6 << 3 | _VARINT, 1])
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
# chunk field number -> (attribute, mask); field 5 is the data, field 6 a push's restore flag (a
# bool: any non-zero varint is true, as protobuf reads it)
_INTS = {1: ("round", _U64), 2: ("block_id", _U32), 3: ("total_bytes", _U64), 4: ("offset", _U64),
         6: ("restore", _U64)}
_LAST_FIELD = {PUSH_FIELD: 6, PULL_FIELD: 5}  # a PullChunk has no field 6: protobuf keeps it as unknown


@dataclass(frozen=True, slots=True)
class ChunkFrame:
    """One chunk (the fields of ps_pb2.PushChunk / PullChunk); ``data`` may view the received bytes."""

    round: int
    block_id: int
    total_bytes: int
    offset: int
    data: bytes | memoryview
    restore: bool = False  # a push's: a recovering node's last result for a resumed session (ps.proto)
    fetch: bool = False  # a push's: a late node asks for a round's result (quorum rounds; protobuf-parsed)
    out_of_data: bool = False  # a push's: the node has left the rounds (uneven inputs; protobuf-parsed)

    @property
    def has_data(self) -> bool:
        """Whether the push carries a block (a fetch or an out-of-data push carries none)."""
        return not (self.fetch or self.out_of_data)


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _head(field: int, round_: int, block_id: int, total: int, offset: int, size: int, tail: int) -> bytes:
    """The outer message's tag and length and the chunk's fields up to its data's bytes."""
    body = bytearray()
    for number, value in ((1, round_), (2, block_id), (3, total), (4, offset)):
        if value:
            body += encode_varint(number << 3 | _VARINT) + encode_varint(value)
    if size:
        body += encode_varint(_DATA << 3 | _LEN) + encode_varint(size)
    return encode_varint(field << 3 | _LEN) + encode_varint(len(body) + size + tail) + bytes(body)


def chunk_frames(field: int, block_id: int, round_: int, data: bytes | memoryview,
                 restore: bool = False) -> list[bytes]:
    """``data`` (any bytes-like object) as serialized chunk messages in the outer message's
    ``field`` (``PUSH_FIELD`` or ``PULL_FIELD``), at most CHUNK_BYTES of data each; at least one (so
    an empty block still tells its total_bytes). ``restore``: a push's restore flag (pulls have none)."""
    view = memoryview(data)
    tail = _RESTORE_TRUE if restore else b""
    frames = []
    for off in range(0, max(len(data), 1), CHUNK_BYTES):
        piece = view[off:off + CHUNK_BYTES]
        frames.append(b"".join((_head(field, round_, block_id, len(data), off, len(piece), len(tail)), piece, tail)))
    return frames


@dataclass(frozen=True, slots=True)
class PushFrames:
    """A block's payload for one round, framed as pushes already: built where the payload is made
    (a worker's codec thread frames it straight from its reused encode buffer: the payload's one
    copy, off the communication thread), written as it is, and kept, immutable, for a re-push
    after a repair. ``len()``: the payload's bytes."""

    block_id: int
    round: int
    frames: tuple[bytes, ...]
    nbytes: int

    @classmethod
    def of(cls, block_id: int, round_: int, payload: bytes | memoryview) -> "PushFrames":
        """``payload`` (any bytes-like object, read once here) framed for ``block_id`` and ``round_``."""
        return cls(block_id, round_, tuple(chunk_frames(PUSH_FIELD, block_id, round_, payload)), len(payload))

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        """The payload, read back from the frames (a loopback test's shard: the push is the result)."""
        return b"".join(bytes(read_chunk(frame, PUSH_FIELD).data) for frame in self.frames)


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


def read_chunk(raw: bytes, field: int) -> ChunkFrame | None:
    """The chunk in ``raw``, a serialized outer message holding it in ``field`` (``PUSH_FIELD``:
    an ExchangeRequest's push; ``PULL_FIELD``: an ExchangeResponse's pull), if it has the plain
    shape; else None: the caller parses it with protobuf."""
    if len(raw) < 2 or raw[0] != (field << 3 | _LEN):
        return None
    length = _varint(raw, 1, len(raw))
    if length is None or length[1] + length[0] != len(raw):
        return None
    pos, end, last = length[1], len(raw), _LAST_FIELD[field]
    fields: dict[str, int] = {"round": 0, "block_id": 0, "total_bytes": 0, "offset": 0, "restore": 0}
    seen = 0
    data: bytes | memoryview = b""
    while pos < end:
        tag = raw[pos]  # every chunk tag is one byte; a longer one is for protobuf
        pos += 1
        number, wire_type = tag >> 3, tag & 7
        if tag >= 0x80 or not 1 <= number <= last or seen & (1 << number):
            return None  # unknown or repeated field: protobuf's rules decide
        seen |= 1 << number
        if number == _DATA:
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
            name, mask = _INTS[number]
            fields[name] = value[0] & mask
            pos = value[1]
    restore = fields.pop("restore") != 0
    return ChunkFrame(data=data, restore=restore, **fields)
