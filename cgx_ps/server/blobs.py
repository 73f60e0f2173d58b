"""A small rendezvous store on the shard: one rank puts a blob, the others wait for and get it.

Used for broadcasts (initial parameters, optimizer state). Blobs live until the session resets;
their total size is capped so a misbehaving client cannot exhaust the shard's memory.
"""

from __future__ import annotations

import asyncio

__all__ = ["BlobStore", "BlobError"]


class BlobError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "exists" | "full" | "timeout"


class BlobStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._blobs: dict[str, bytes] = {}
        self._ready: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, int] = {}  # GetBlob calls waiting per key

    def put(self, key: str, data: bytes) -> None:
        old = self._blobs.get(key)
        if old is not None:
            if old != data:
                raise BlobError("exists", f"blob {key!r} already holds different bytes")
            return  # a retried put
        if self.used + len(data) > self.capacity:
            raise BlobError("full", f"blob {key!r} of {len(data)} bytes exceeds the shard's blob "
                                    f"capacity ({self.used} of {self.capacity} bytes used)")
        self._blobs[key] = data
        self.used += len(data)
        self._event(key).set()

    async def get(self, key: str, timeout_s: float) -> bytes:
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
