"""An async byte budget: backpressure on pushes so buffered memory stays bounded."""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["ByteBudget"]


class ByteBudget:
    """Reserve bytes before buffering them; release after summing. FIFO, so no starvation.

    A stream that cannot reserve stops reading, and gRPC flow control then slows the sender.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def try_acquire(self, n: int) -> bool:
        """Reserve ``n`` bytes if they fit now and nobody waits before us (FIFO); else False.
        A push's common case, without the task and timer a bounded ``acquire`` would cost."""
        if n > self.capacity:  # callers refuse such requests first (Register, blob admission)
            raise ValueError(f"cannot reserve {n} bytes from a budget of {self.capacity}")
        if not self._waiters and self.used + n <= self.capacity:
            self.used += n
            return True
        return False

    async def acquire(self, n: int) -> None:
        if self.try_acquire(n):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we were cancelled
            else:
                try:
                    self._waiters.remove((n, fut))
                except ValueError:
                    pass  # release() already dropped it
                self.release(0)  # smaller requests queued behind this one may fit now
            raise

    def release(self, n: int) -> None:
        self.used -= n
        while self._waiters and (self._waiters[0][1].done() or self.used + self._waiters[0][0] <= self.capacity):
            size, fut = self._waiters.popleft()
            if not fut.done():  # a cancelled waiter is dropped without taking anything
                self.used += size
                fut.set_result(None)
