"""One Exchange stream, whichever data plane carries it: the interface ``ExchangeStream`` drives
(exchange_stream.py), and its gRPC implementation (the raw plane's: raw_call.py; which of the two a
shard's stream takes: dataplane.py).

An ``ExchangeCall`` takes frames already serialized (a Hello, pushes: net/chunk_frames.py) with
``write`` and yields the shard's results by async iteration (``read_result``: a result chunk read
without protobuf, or an ExchangeResponse). Both planes end a stream alike: iteration stops at the
shard's clean end; anything else raises ``StreamEnded`` (worker/errors.py) with the name of a gRPC
status code, the shard's own status, UNAVAILABLE when the connection broke, INTERNAL for a message
that cannot be read, and CANCELLED once the worker called ``cancel()``, which makes a read or a
write under way fail at once. A write to a stream that has ended raises its end too: nothing is
dropped unannounced. recovery.py decides from that code alone, with no transport's types.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Protocol

import grpc

from ...net.chunk_frames import PULL_FIELD, ChunkFrame, read_chunk
from ...v1 import ps_pb2
from ..errors import StreamEnded

__all__ = ["ExchangeCall", "GrpcExchangeCall", "Response", "read_result"]

Response = ChunkFrame | ps_pb2.ExchangeResponse  # what a stream yields: a result chunk, or a RoundError
# the method path the generated stub calls, from the .proto
_EXCHANGE = f"/{ps_pb2.DESCRIPTOR.services_by_name['ParameterServer'].full_name}/Exchange"
# What grpc.aio raises for a write to a call that has ended (its status goes to the reader)
_ENDED_WRITES = (asyncio.InvalidStateError, grpc.aio.UsageError)
_CANCELLED = "the worker cancelled the stream"


class ExchangeCall(Protocol):
    """One Exchange stream to a shard (see the module's docstring for how it ends)."""

    plane: str  # the data plane that carries it: "grpc" or "raw"

    async def write(self, frame: bytes | memoryview) -> None:
        """Send one serialized ExchangeRequest. Raises StreamEnded once the stream has ended."""

    def __aiter__(self) -> AsyncIterator[Response]:
        """The shard's results, until its clean end; raises StreamEnded for any other end."""

    def cancel(self) -> None:
        """End the stream now: a read or write under way, and any later, raises StreamEnded CANCELLED."""


def read_result(raw: bytes | memoryview) -> Response:
    """The Exchange stream's response deserializer: a result chunk as our shards send it, read
    without protobuf (``chunk_frames.read_chunk``); anything else (a RoundError) parsed by
    protobuf, which raises for bytes it refuses, as the generated stub's deserializer does."""
    frame = read_chunk(raw, PULL_FIELD)
    return frame if frame is not None else ps_pb2.ExchangeResponse.FromString(raw)


class GrpcExchangeCall:
    """An Exchange stream over the shard's gRPC port: a grpc.aio stream-stream call that takes
    serialized requests and reads results with ``read_result``; its AioRpcError, and the
    CancelledError grpc.aio raises in a read or write of a call cancelled locally, become StreamEnded."""

    plane = "grpc"

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        method = channel.stream_stream(_EXCHANGE, request_serializer=None, response_deserializer=read_result)
        self._call = method(metadata=metadata)
        self._cancelled = False

    async def write(self, frame: bytes | memoryview) -> None:
        try:
            await self._call.write(frame)
        except grpc.aio.AioRpcError as exc:
            raise _ended(exc) from None
        except _ENDED_WRITES:
            raise await self._end() from None
        except asyncio.CancelledError:
            if not self._cancelled_by_us():
                raise
            raise StreamEnded("CANCELLED", _CANCELLED) from None

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def __aiter__(self) -> AsyncIterator[Response]:
        return self._results()

    async def _results(self) -> AsyncIterator[Response]:
        try:
            async for response in self._call:
                if response is None:  # grpc.aio hands on None where the deserializer raised
                    self._call.cancel()
                    raise StreamEnded("INTERNAL", "malformed message from the shard")
                yield response
        except grpc.aio.AioRpcError as exc:
            raise _ended(exc) from None
        except asyncio.CancelledError:
            if not self._cancelled_by_us():
                raise
            raise StreamEnded("CANCELLED", _CANCELLED) from None

    async def _end(self) -> StreamEnded:
        """How the call ended, for a write after its end: its status, or UNAVAILABLE after a clean end."""
        if self._cancelled:
            return StreamEnded("CANCELLED", _CANCELLED)
        code = await self._call.code()
        if code == grpc.StatusCode.OK:
            return StreamEnded("UNAVAILABLE", "the shard ended the stream")
        return StreamEnded(code.name, await self._call.details() or "")

    def _cancelled_by_us(self) -> bool:
        """Whether a CancelledError out of the call is our cancel()'s (grpc.aio raises it in a read
        or write of a call cancelled locally), not the cancellation of the task that waits in it."""
        task = asyncio.current_task()
        return self._cancelled and not (task is not None and task.cancelling())


def _ended(exc: grpc.aio.AioRpcError) -> StreamEnded:
    return StreamEnded(exc.code().name, exc.details() or "")
