"""A small rendezvous store on the shard: one rank puts a blob, the others wait for and get it.

Used for broadcasts (initial parameters, optimizer state). Blobs belong to the current session:
the store is cleared when a session starts or ends, each blob remembers the member that wrote
it (readers accept only their root rank's), and keys, data and uploads still arriving all count
against one capacity, so a misbehaving member cannot hold more than that: an upload reserves its
size before its first byte is kept, and is assembled in place (no second copy to join). The shard never interprets a blob's
bytes; workers parse them with a format that cannot execute code (cgx_ps/worker/broadcast/blob_format.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ..errors import AlreadyExists, BadRequest, LimitExceeded, ProtocolError, TimedOut

__all__ = ["BadBlob", "BlobError", "BlobKeyTaken", "BlobNotPut", "BlobStore", "BlobStoreFull", "BlobUpload",
           "MAX_BLOB_WAIT_S", "MAX_KEY_BYTES"]

MAX_KEY_BYTES = 256  # workers use keys like "broadcast/17"
MAX_BLOB_WAIT_S = 3600.0  # GetBlob: a waiter holds a call slot, so its wait is bounded

Writer = tuple[str, int]  # (node id, member) of the session member that put a blob


class BlobError(ProtocolError):
    """The blob store refuses; the subclass says why (and so the status the caller sees)."""


class BadBlob(BlobError, BadRequest):
    """A malformed key, chunk or wait."""


class BlobStoreFull(BlobError, LimitExceeded):
    """The blob would exceed the store's capacity."""


class BlobKeyTaken(BlobError, AlreadyExists):
    """The key already holds different bytes."""


class BlobNotPut(BlobError, TimedOut):
    """The blob did not arrive in time (a reader's wait, or a writer's upload)."""


@dataclass(eq=False)
class BlobUpload:
    """One PutBlob stream's chunks, checked as they come: one key, in order, no overrun, and
    the whole blob within ``timeout_s`` (it holds memory while it arrives)."""

    key: str
    total: int
    timeout_s: float = math.inf
    filled: int = 0
    buffer: bytearray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.buffer = bytearray(self.total)  # reserved in the store before this is created

    async def receive(self, first: Any, read: Callable[[], Awaitable[Any]]) -> bytes:
        """The blob's bytes: ``first`` (a ps_pb2.BlobChunk), then the chunks ``read`` returns
        until it returns None (the end of the stream)."""
        deadline = time.monotonic() + self.timeout_s
        chunk = first
        while chunk is not None:
            self.add(chunk)
            try:
                chunk = await asyncio.wait_for(read(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise BlobNotPut(f"blob {self.key!r}: {self.filled} of {self.total} bytes arrived within "
                                 f"{self.timeout_s:g}s") from None
        return self.data()

    def add(self, chunk: Any) -> None:  # a ps_pb2.BlobChunk
        problem = None
        if chunk.key != self.key:
            problem = f"chunk names blob {chunk.key[:64]!r}; one PutBlob stream carries one blob"
        elif chunk.total_bytes != self.total:
            problem = f"chunk says total_bytes={chunk.total_bytes}, the first chunk said {self.total}"
        elif chunk.offset != self.filled:
            problem = f"chunk at offset {chunk.offset}, expected {self.filled} (chunks must be in order, no gaps)"
        elif self.filled + len(chunk.data) > self.total:
            problem = f"chunk of {len(chunk.data)} bytes at offset {self.filled} overruns total_bytes={self.total}"
        if problem is not None:
            raise BadBlob(f"blob {self.key!r}: {problem}")
        self.buffer[self.filled: self.filled + len(chunk.data)] = chunk.data
        self.filled += len(chunk.data)

    def data(self) -> bytearray:
        if self.filled != self.total:
            raise BadBlob(f"blob {self.key!r}: stream ended at {self.filled} of {self.total} bytes")
        return self.buffer  # stored as it is: the store never mutates it


class BlobStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0  # key and data bytes, stored or reserved by uploads still arriving
        self._blobs: dict[str, tuple[bytes, Writer]] = {}
        self._ready: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, int] = {}  # GetBlob calls waiting per key

    @staticmethod
    def _cost(key: str, nbytes: int) -> int:
        return len(key.encode()) + nbytes

    def admit(self, key: str, total: int) -> None:
        """Raise if a blob of ``total`` bytes under ``key`` cannot be stored."""
        _check_key(key)
        if self.used + self._cost(key, total) > self.capacity:
            raise BlobStoreFull(f"blob {key!r} of {total} bytes exceeds the shard's blob capacity "
                                f"({self.used} of {self.capacity} bytes used)")

    def reserve(self, key: str, total: int) -> int:
        """Hold room for an upload before its bytes arrive; returns the bytes reserved, to give
        back with ``release`` (whether or not the upload was stored)."""
        self.admit(key, total)
        cost = self._cost(key, total)
        self.used += cost
        return cost

    def release(self, reserved: int) -> None:
        self.used -= reserved

    def put(self, key: str, data: bytes | bytearray, writer: Writer, reserved: int = 0) -> None:
        """Store a blob; ``reserved`` bytes held by its upload become the stored blob's."""
        old = self._blobs.get(key)
        if old is not None:
            if old != (data, writer):
                raise BlobKeyTaken(f"blob {key!r} already holds different bytes")
            self.release(reserved)  # a retried put: the first copy stays
            return
        if not reserved:
            reserved = self.reserve(key, len(data))
        self._blobs[key] = (data, writer)
        self.used += self._cost(key, len(data)) - reserved
        self._event(key).set()

    async def get(self, key: str, timeout_s: float) -> tuple[bytes, Writer]:
        """The blob under ``key`` and its writer, waiting up to ``timeout_s`` for it to be put."""
        if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_BLOB_WAIT_S):
            raise BadBlob(f"timeout_s must be finite, in (0, {MAX_BLOB_WAIT_S:g}], got {timeout_s!r}")
        _check_key(key)
        deadline = asyncio.get_running_loop().time() + timeout_s
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            while key not in self._blobs:  # loop: a session reset may clear the blob we woke for
                left = deadline - asyncio.get_running_loop().time()
                try:
                    await asyncio.wait_for(self._event(key).wait(), max(left, 0))
                except asyncio.TimeoutError:
                    raise BlobNotPut(f"blob {key!r} was not put within {timeout_s:g}s: did the root "
                                     f"rank fail (see its log) or skip this broadcast?") from None
            return self._blobs[key]
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]
                if key not in self._blobs:  # nobody waits for it and it never came: forget its event
                    self._ready.pop(key, None)

    def clear(self) -> None:
        # uploads still arriving keep their reservations: they release them when they end
        self.used -= sum(self._cost(k, len(data)) for k, (data, _) in self._blobs.items())
        self._blobs.clear()
        # Forget fired events; waiters on unfired ones keep waiting for the new session's put.
        self._ready = {k: e for k, e in self._ready.items() if not e.is_set()}

    def _event(self, key: str) -> asyncio.Event:
        event = self._ready.get(key)
        if event is None:
            event = self._ready[key] = asyncio.Event()
        return event


def _check_key(key: str) -> None:
    if not key or len(key.encode()) > MAX_KEY_BYTES:
        raise BadBlob(f"blob keys must be 1..{MAX_KEY_BYTES} bytes, got {len(key.encode())}")
