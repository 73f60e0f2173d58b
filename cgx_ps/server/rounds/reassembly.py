"""Pushed chunks into whole block payloads, within the shard's memory budget and deadlines.

The size of a block is checked against the layout before a byte is buffered, and the whole
block is reserved from the budget before its first chunk is kept: a block holds all of its
budget or none, so streams that each hold part of the budget never wait on each other forever.
A stream sends one block's chunks back to back, so it holds at most one reservation while it
waits. A block must arrive whole within the round timeout: a client that stops halfway, or
trickles a byte per chunk, must not hold the shard's memory forever.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ... import timeline
from .budget import ByteBudget
from ..errors import BadRequest, LimitExceeded, TimedOut

__all__ = ["InflightPushes", "PushAssembler"]


class InflightPushes:
    """Pushed blocks held by the shard, from their first chunk until summed: their bytes are
    reserved from the budget (backpressure), their count keeps a drain or a new job waiting."""

    def __init__(self, capacity: int, gauge: Any = None) -> None:
        self.budget = ByteBudget(capacity)
        self.count = 0
        self._gauge = gauge  # Prometheus: bytes held

    async def reserve(self, nbytes: int, block_id: int, timeout_s: float) -> None:
        # Room now (the common case): no wait, so no task and timer for a bounded one
        if not self.budget.try_acquire(nbytes):
            try:
                await asyncio.wait_for(self.budget.acquire(nbytes), timeout_s)
            except asyncio.TimeoutError:
                raise LimitExceeded(f"block {block_id}: the shard's memory budget ({self.budget.capacity} "
                                    f"bytes) stayed full for {timeout_s:g}s") from None
        self.count += 1
        self._update()

    def release(self, nbytes: int) -> None:
        self.budget.release(nbytes)
        self.count -= 1
        self._update()

    def _update(self) -> None:
        if self._gauge is not None:
            self._gauge.set(self.budget.used)


@dataclass(eq=False)
class _Block:
    block_id: int
    round: int
    total: int  # also the bytes reserved for it
    deadline: float  # time.monotonic() by which the last chunk must have arrived
    filled: int = 0
    buffer: bytearray | None = None  # the whole block, once a second chunk shows it needs one
    first: bytes | memoryview = b""  # the first chunk, kept as it came until then
    started: int | None = None  # timeline.mark() at the first chunk


class PushAssembler:
    """The block one Exchange stream is pushing, chunk by chunk (frames.PushFrame)."""

    def __init__(self, inflight: InflightPushes, round_timeout_s: float, track: str = "receive") -> None:
        self.inflight = inflight
        self.round_timeout_s = round_timeout_s
        self.partial: _Block | None = None
        self.track = track  # the timeline's row for this stream's pushes

    async def next_message(self, read: Callable[[], Awaitable[Any]]) -> Any:
        """``read()``, bounded by the deadline of the block under way (one deadline per block,
        not per chunk)."""
        b = self.partial
        if b is None:
            return await read()
        try:
            return await asyncio.wait_for(read(), max(b.deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise TimedOut(f"sent {b.filled} of {b.total} bytes of block {b.block_id} round {b.round} "
                           f"in {self.round_timeout_s:g}s; a block must arrive whole within the "
                           f"round timeout") from None

    async def add(self, chunk: Any, allowed_sizes: Callable[[int, int], tuple[int, ...] | range]
                  ) -> bytes | memoryview | bytearray | None:
        """Add a chunk to its block; the payload once the block is complete. ``allowed_sizes``
        (block id, round): the wire sizes the layout allows (it raises for unknown blocks)."""
        b = self.partial
        if b is None:
            b = await self._start(chunk, allowed_sizes(chunk.block_id, chunk.round))
        elif chunk.block_id != b.block_id:
            raise BadRequest(f"block {chunk.block_id}: chunk arrived while block {b.block_id} has {b.filled} of "
                             f"{b.total} bytes; a stream must send one block's chunks contiguously")
        if chunk.round != b.round or chunk.total_bytes != b.total or chunk.offset != b.filled:
            raise BadRequest(f"block {chunk.block_id}: chunk (round {chunk.round}, offset {chunk.offset}, "
                             f"total {chunk.total_bytes}) does not continue round {b.round} at "
                             f"offset {b.filled} of {b.total}")
        n = len(chunk.data)
        if n == 0 or b.filled + n > b.total:
            raise BadRequest(f"block {chunk.block_id}: chunk of {n} bytes at offset {chunk.offset} "
                             f"overruns the block's {b.total} bytes")
        # One chunk (the common case for compressed blocks): no copy. Several: each is copied
        # once into a buffer of the block's size, allocated when the second one arrives.
        if b.filled == 0:
            b.first = chunk.data
        else:
            if b.buffer is None:
                b.buffer = bytearray(b.total)
                b.buffer[:len(b.first)] = b.first
                b.first = b""
            b.buffer[b.filled:b.filled + n] = chunk.data
        b.filled += n
        if b.filled < b.total:
            return None
        self.partial = None
        timeline.since(b.started, "receive", b.round, self.track, block=b.block_id, bytes=b.total)
        return b.first if b.buffer is None else b.buffer

    async def _start(self, chunk: Any, sizes: tuple[int, ...] | range) -> _Block:
        if chunk.total_bytes not in sizes:
            says = (f"{sizes.start} to {sizes.stop - 1}" if isinstance(sizes, range)
                    else f"{sizes[0]} (or {sizes[1]} uncompressed)")
            raise BadRequest(f"block {chunk.block_id}: push of {chunk.total_bytes} bytes, the layout "
                             f"says {says}")
        started = timeline.mark()  # waiting for room in the budget is part of receiving
        await self.inflight.reserve(chunk.total_bytes, chunk.block_id, 2 * self.round_timeout_s)
        self.partial = _Block(chunk.block_id, chunk.round, chunk.total_bytes,
                              deadline=time.monotonic() + self.round_timeout_s, started=started)
        return self.partial

    def abandon(self) -> None:
        """The stream ended mid-block: give the block's reservation back."""
        if self.partial is not None:
            self.inflight.release(self.partial.total)
            self.partial = None
