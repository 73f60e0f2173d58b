"""What a step of the block pipeline measured: ``StepStats`` (the bytes it sent, how long it
waited for communication) and ``CommSpan``, the first push to the last result, noted on the
communication thread and taken on the front end's.

``BlockPipeline.finish_step`` returns a ``StepStats``; the front ends hand it to their callers
(``DistributedOptimizer.stats``), to auto mode (``tuning/tuner.py``) and to the metrics exporter.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["CommSpan", "StepStats"]


@dataclass
class StepStats:
    """What the last finished step sent, and how long it waited for communication."""

    step: int = 0
    bytes_pushed: int = 0  # compressed bytes this process pushed (its share of the node's blocks)
    fp32_bytes: int = 0  # what the same blocks weigh uncompressed
    exposed_comm_s: float = 0.0  # time finish_step() blocked waiting for blocks in flight
    compressed: bool = True  # False during warm-up steps and when auto mode does not compress
    backward_s: float = 0.0  # the front end's first to last gradient: what communication can hide behind
    comm_window_s: float = 0.0  # this process's first push to its last result
    # when each tensor's gradient arrived (time.perf_counter()), where the front end said so: backward's
    # order for auto mode's model; {} where it did not (the DDP hook's steps through DDP's allreduce)
    arrivals: dict[str, float] = field(default_factory=dict)
    in_place_blocks: int = 0  # blocks encoded from and decoded into the front end's memory: no copies
    early_gradients: int = 0  # DDP hook: gradients it took from autograd before DDP copied them (ddp_hook.py)
    # tensors whose gradient on this rank had NaN/Inf (with allow_non_finite: every rank then
    # decodes NaN for their blocks, and a GradScaler skips the step); () for a finite step
    non_finite_tensors: tuple[str, ...] = ()
    non_finite_average: bool = False  # the step's average had NaN/Inf (this rank's gradient or another's)
    path: str = "shards"  # how the step was averaged: "shards", or "allreduce" (auto mode's
    # uncompressed steps with a process group: DDP's own allreduce for the hook, all_reduce per
    # block for the optimizer; not the shards)

    @property
    def ratio(self) -> float:
        return self.fp32_bytes / self.bytes_pushed if self.bytes_pushed else 0.0


class CommSpan:
    """First push to last result of a step: noted on the communication thread, taken on the
    front end's, under a lock."""

    def __init__(self) -> None:
        self._lock, self._first, self._last = threading.Lock(), float("inf"), 0.0

    def note(self, first: float = float("inf"), last: float = 0.0) -> None:
        with self._lock:
            self._first, self._last = min(self._first, first), max(self._last, last)

    def take(self) -> float:
        with self._lock:
            span, self._first, self._last = max(0.0, self._last - self._first), float("inf"), 0.0
        return span
