"""The Exchange stream's bulk messages in raw bytes: a pushed chunk read without a protobuf copy,
a result chunk framed once for every node.

The gRPC handlers take and give raw bytes (rpc.py), so the shard decides how its hottest
messages are (de)serialized. With protobuf objects a pushed chunk's data was copied three times
after gRPC's own copy (parse, and each read of ``chunk.data``), and a result was serialized once
per node; profiles of benchmarks/server.py put these copies at about a quarter of the event
loop's time (py-spy of the shard's event loop).

``read_push`` reads the shape our clients send (an ExchangeRequest holding one PushChunk) with
``chunkframes.read_chunk``, the chunk's data a view into the received bytes; anything else (a
Hello, unknown or repeated fields, truncation) goes to the protobuf parser, whose answer, or
refusal, stands (tests/test_frames.py checks this on arbitrary bytes).

``ResultFrames`` is a round's result as the frames every node is sent. The kernel thread that
encodes the sum frames it straight from the encode buffer (aggregator.py): the result's one copy,
off the event loop. Those same frames are what a retried push gets again and what the block keeps
as its last result; the result's bytes are never held a second time (``payload`` views them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...net.chunk_frames import PULL_FIELD, PUSH_FIELD, ChunkFrame, chunk_frames, read_chunk
from ...v1 import ps_pb2
from ..errors import BadRequest
from .gate import parse_message

__all__ = ["PushFrame", "ResultFrames", "read_push", "result_frames"]

# One chunk as read from the wire (``chunkframes.read_chunk``, shared with the worker's results).
PushFrame = ChunkFrame


def _fast_push(raw: bytes) -> PushFrame | None:
    """The push in ``raw`` if it has the plain shape, else None (the caller parses it fully)."""
    return read_chunk(raw, PUSH_FIELD)


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
    return PushFrame(c.round, c.block_id, c.total_bytes, c.offset, c.data, c.restore, c.fetch, c.out_of_data)


def result_frames(block_id: int, round_: int, data: bytes) -> list[bytes]:
    """A result as serialized ExchangeResponse PullChunks of at most CHUNK_BYTES of data, built
    once and written as they are to every node's stream; at least one (so an empty result still
    tells its total_bytes)."""
    return chunk_frames(PULL_FIELD, block_id, round_, data)


@dataclass(frozen=True, slots=True)
class ResultFrames:
    """A round's result for a block, framed once as PullChunks (``result_frames``) and written as
    it is to every node's stream. Immutable: kept as the block's last result for a retried push,
    and queued on several streams at once. ``len()``: the result's bytes."""

    block_id: int
    round: int
    frames: tuple[bytes, ...]
    nbytes: int

    @classmethod
    def of(cls, block_id: int, round_: int, result: bytes | memoryview) -> "ResultFrames":
        """``result`` (any bytes-like object, read once here: it may be reused afterwards) framed
        for ``block_id`` and ``round_``."""
        return cls(block_id, round_, tuple(result_frames(block_id, round_, result)), len(result))

    def __len__(self) -> int:
        return self.nbytes

    @property
    def payload(self) -> bytes | memoryview:
        """The result's bytes: a view into the frame when there is one (a PullChunk's data is its
        last field: it ends the frame), else read back from the frames."""
        if len(self.frames) == 1:
            frame = self.frames[0]
            return memoryview(frame)[len(frame) - self.nbytes:]
        return b"".join(bytes(read_chunk(frame, PULL_FIELD).data) for frame in self.frames)

    def __bytes__(self) -> bytes:
        return bytes(self.payload)
