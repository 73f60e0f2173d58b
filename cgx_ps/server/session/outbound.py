"""One member's Exchange stream, outbound: the results queued for it and the writer sending them.

A client that stops reading must not grow the shard's memory: past ``result_cap`` queued bytes,
or with one write held up for the round timeout (gRPC flow control holds a write until the
client reads), its stream ends with RESOURCE_EXHAUSTED and what was queued is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from ... import timeline
from ...v1 import ps_pb2
from ..errors import LimitExceeded, ProtocolError

__all__ = ["NodeStream"]

log = logging.getLogger(__name__)

_STOP = object()  # queue sentinel: the writer ends the stream


@dataclass(eq=False)
class NodeStream:
    node_id: str
    member: int = 0
    result_cap: int = 1 << 62  # result bytes that may wait for this client (the session sets it)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    queued_bytes: int = 0  # result bytes waiting for this client to read them
    error: ProtocolError | None = None  # why the stream ends; the first cause stands
    push_tasks: set[asyncio.Task] = field(default_factory=set)  # its pushes still being summed
    stopping: bool = False

    def send(self, messages: Sequence[bytes], nbytes: int, block_id: int, round_: int) -> None:
        """Queue a result of (block, round) (serialized once, frames.ResultFrames, and shared by
        every node's stream) for the writer, unless the client has stopped reading."""
        if self.queued_bytes + nbytes > self.result_cap:
            self.stop(LimitExceeded(f"node {self.node_id} member {self.member} is not reading its results "
                                    f"({self.queued_bytes} bytes waiting)"))
            return
        self.queued_bytes += nbytes
        self.queue.put_nowait((messages, nbytes, (block_id, round_)))

    def send_control(self, message: ps_pb2.ExchangeResponse) -> None:
        """Queue a small in-band message, a RoundError or a LateNotice (not counted against the cap)."""
        self.queue.put_nowait(([message], 0, None))  # not a result: no (block, round) for the timeline

    def fail(self, error: ProtocolError) -> None:
        """Record why the stream will end, without ending it yet (results due still go out)."""
        self.error = self.error or error

    def stop(self, error: ProtocolError | None = None) -> None:
        """End the stream (the writer sends what is queued first), with ``error`` if none yet."""
        if error is not None:
            self.fail(error)
        if not self.stopping:
            self.stopping = True
            self.queue.put_nowait(_STOP)

    async def write_results(self, write: Callable[[Any], Awaitable[None]], timeout_s: float) -> None:
        """The writer: send what is queued until the stream stops, or until the client leaves one
        write waiting ``timeout_s`` (then ``error`` says so and the queue is dropped)."""
        while True:
            item = await self.queue.get()
            if item is _STOP:
                return
            messages, nbytes, result_of = item
            sending = timeline.mark()
            for message in messages:
                try:
                    # asyncio.timeout, not wait_for: wait_for wraps every write in a task of its own
                    async with asyncio.timeout(timeout_s):
                        await write(message)
                except TimeoutError:
                    self.fail(LimitExceeded(f"node {self.node_id} member {self.member} has not read its results "
                                            f"for {timeout_s:g}s ({self.queued_bytes} bytes waiting)"))
                    log.warning("node %s member %d stopped reading: %s", self.node_id, self.member,
                                self.error.message)
                    while not self.queue.empty():  # the client will never read these: free them now
                        self.queue.get_nowait()
                    self.queued_bytes = 0
                    return
            if result_of is not None:
                timeline.result_sent(sending, *result_of, nbytes, self.node_id, self.member)
            self.queued_bytes -= nbytes

