"""Log lines that a flood cannot multiply: a shard's refusals of a hostile client, a worker's
non-finite gradients every step of a diverged run. Shared by the shard and the worker."""

from __future__ import annotations

import logging
import time

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """At most ``burst`` lines per ``window_s`` per key; what is dropped is counted and reported
    with the next line that gets through."""

    def __init__(self, logger: logging.Logger, burst: int = 10, window_s: float = 10.0) -> None:
        self.logger, self.burst, self.window_s = logger, burst, window_s
        self._windows: dict[str, tuple[float, int, int]] = {}  # key -> (start, logged, dropped)

    def warning(self, key: str, message: str, *args: object) -> None:
        now = time.monotonic()
        start, logged, dropped = self._windows.get(key, (now, 0, 0))
        if now - start >= self.window_s:
            start, logged = now, 0
        if logged >= self.burst:
            self._windows[key] = (start, logged, dropped + 1)
            return
        if dropped:
            message += f" ({dropped} similar lines suppressed)"
        self._windows[key] = (start, logged + 1, 0)
        self.logger.warning(message, *args)

    def __len__(self) -> int:  # keys seen: bounded by the number of methods, not by callers
        return len(self._windows)
