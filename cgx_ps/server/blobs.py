"""A small rendezvous store on the shard: one rank puts a blob, the others wait for and get it.

Used for broadcasts (initial parameters, optimizer state). Blobs belong to the current session:
the store is cleared when a session starts or ends, each blob remembers the member that wrote
it (readers accept only their root rank's), and keys and data both count against a capacity,
so a misbehaving client cannot exhaust the shard's memory. The shard never interprets a blob's
bytes; workers parse them with a format that cannot execute code (cgx_ps/worker/blobformat.py).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

__all__ = ["BlobError", "BlobStore", "BlobUpload", "MAX_KEY_BYTES"]

MAX_KEY_BYTES = 256  # workers use keys like "broadcast/17"

Writer = tuple[str, int]  # (node id, member) of the session member that put a blob


class BlobError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "exists" | "full" | "timeout" | "key" | "chunk"


@dataclass(eq=False)
class BlobUpload:
    """One PutBlob stream's chunks, checked as they come: one key, in order, no overrun."""

    key: str
    total: int
    deadline: float = math.inf
    filled: int = 0
    parts: list[bytes] = field(default_factory=list)

    def add(self, chunk) -> None:  # a ps_pb2.BlobChunk
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
            raise BlobError("chunk", f"blob {self.key!r}: {problem}")
        self.parts.append(chunk.data)
        self.filled += len(chunk.data)

    def data(self) -> bytes:
        if self.filled != self.total:
            raise BlobError("chunk", f"blob {self.key!r}: stream ended at {self.filled} of {self.total} bytes")
        return b"".join(self.parts)


class BlobStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0  # key and data bytes
        self._blobs: dict[str, tuple[bytes, Writer]] = {}
        self._ready: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, int] = {}  # GetBlob calls waiting per key

    @staticmethod
    def _cost(key: str, nbytes: int) -> int:
        return len(key.encode()) + nbytes

    def admission(self, key: str, total: int) -> BlobError | None:
        """Why a blob of ``total`` bytes under ``key`` cannot be stored, or None."""
        if not key or len(key.encode()) > MAX_KEY_BYTES:
            return BlobError("key", f"blob keys must be 1..{MAX_KEY_BYTES} bytes, got {len(key.encode())}")
        if self.used + self._cost(key, total) > self.capacity:
            return BlobError("full", f"blob {key!r} of {total} bytes exceeds the shard's blob capacity "
                                     f"({self.used} of {self.capacity} bytes used)")
        return None

    def put(self, key: str, data: bytes, writer: Writer) -> None:
        old = self._blobs.get(key)
        if old is not None:
            if old != (data, writer):
                raise BlobError("exists", f"blob {key!r} already holds different bytes")
            return  # a retried put
        problem = self.admission(key, len(data))
        if problem is not None:
            raise problem
        self._blobs[key] = (data, writer)
        self.used += self._cost(key, len(data))
        self._event(key).set()

    async def get(self, key: str, timeout_s: float) -> tuple[bytes, Writer]:
        if not key or len(key.encode()) > MAX_KEY_BYTES:
            raise BlobError("key", f"blob keys must be 1..{MAX_KEY_BYTES} bytes, got {len(key.encode())}")
        deadline = asyncio.get_running_loop().time() + timeout_s
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            while key not in self._blobs:  # loop: a session reset may clear the blob we woke for
                left = deadline - asyncio.get_running_loop().time()
                try:
                    await asyncio.wait_for(self._event(key).wait(), max(left, 0))
                except asyncio.TimeoutError:
                    raise BlobError("timeout", f"blob {key!r} was not put within {timeout_s:g}s: did the root "
                                               f"rank fail (see its log) or skip this broadcast?") from None
            return self._blobs[key]
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]
                if key not in self._blobs:  # nobody waits for it and it never came: forget its event
                    self._ready.pop(key, None)

    def clear(self) -> None:
        self._blobs.clear()
        self.used = 0
        # Forget fired events; waiters on unfired ones keep waiting for the new session's put.
        self._ready = {k: e for k, e in self._ready.items() if not e.is_set()}

    def _event(self, key: str) -> asyncio.Event:
        event = self._ready.get(key)
        if event is None:
            event = self._ready[key] = asyncio.Event()
        return event
