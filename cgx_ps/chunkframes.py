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
bytes equal ``SerializeToString``'s (tests/test_frames.py checks both messages). Reading stays
with each end: the shard reads pushes with its own fast path (server/frames.py).
"""

from __future__ import annotations

from .transport import CHUNK_BYTES

__all__ = ["PULL_FIELD", "PUSH_FIELD", "chunk_frames", "encode_varint"]

PUSH_FIELD = 2  # ExchangeRequest.push
PULL_FIELD = 1  # ExchangeResponse.pull
_VARINT = 0
_LEN = 2
_DATA = 5  # the chunk's data field; restore (a push's field 6) comes after it
_RESTORE_TRUE = bytes([6 << 3 | _VARINT, 1])


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


def chunk_frames(field: int, block_id: int, round_: int, data: bytes, restore: bool = False) -> list[bytes]:
    """``data`` as serialized chunk messages in the outer message's ``field`` (``PUSH_FIELD`` or
    ``PULL_FIELD``), at most CHUNK_BYTES of data each; at least one (so an empty block still tells
    its total_bytes). ``restore``: a push's restore flag (pulls have none)."""
    view = memoryview(data)
    tail = _RESTORE_TRUE if restore else b""
    frames = []
    for off in range(0, max(len(data), 1), CHUNK_BYTES):
        piece = view[off:off + CHUNK_BYTES]
        frames.append(b"".join((_head(field, round_, block_id, len(data), off, len(piece), len(tail)), piece, tail)))
    return frames
