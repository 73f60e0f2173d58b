"""The recorder: one process's events in a ring buffer, written whole as one Chrome trace file."""

from __future__ import annotations

import itertools
import json
import os
import re
import threading
import time
from collections import deque
from typing import Hashable

from .config import StepRange

ALL_STEPS = StepRange()  # a recorder's default: every step (frozen, so one instance serves all)

__all__ = ["CATEGORIES", "DEFAULT_MAX_EVENTS", "Recorder", "now_ns"]

# About 40 MB of memory and 15 MB of JSON at most; ~800 events per step of a 17M-parameter
# model in 4 MB blocks, so the last ~120 steps of a long run.
DEFAULT_MAX_EVENTS = 100_000
_TRACK_BASE = 1 << 24  # pseudo thread ids of tracks: above Linux's largest thread id (pid_max <= 2**22)
# The category of each span name (Perfetto and chrome://tracing filter by it).
CATEGORIES = {"step": "step", "backward-ready": "step", "exposed wait": "step", "write-back": "step",
              "optimizer": "step", "encode": "codec", "decode": "codec", "sum": "codec", "re-encode": "codec",
              "block": "block", "reduce": "intranode", "local sum": "intranode", "push": "network", "wait": "network", "pull": "network",
              "receive": "network", "send": "network"}

# The system-wide monotonic clock, in ns: CPython reads it with clock_gettime(CLOCK_MONOTONIC) on
# Linux (mach_absolute_time on macOS, QueryPerformanceCounter on Windows, system-wide as well),
# and calls it directly, where time.clock_gettime_ns(CLOCK_MONOTONIC) parses its argument first
# (a test checks that both read the same clock).
now_ns = time.monotonic_ns



class Recorder:
    """The events of one process, in a ring buffer, written as one Chrome trace file."""

    def __init__(self, path: str, process_name: str, sort_index: int = 0, steps: StepRange = ALL_STEPS,
                 max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.path, self.process_name, self.sort_index, self.steps = path, process_name, sort_index, steps
        self.max_events = max_events
        self.pid = os.getpid()
        # (name, start ns, duration ns, tid, args); deque.append is atomic under the GIL: no lock
        # that a signal handler writing the file could find held
        self._events: deque[tuple[str, int, int, int, dict]] = deque(maxlen=max_events)
        # next() of a count is one C call, atomic under the GIL: cheaper than a lock, and no lock
        # that a signal handler writing the file could find held
        self._appended = itertools.count()
        self._tids: dict[int, int] = {}  # threading.get_ident() -> native id (a syscall: asked once)
        self._threads: dict[int, str] = {}  # native thread id -> name
        self._tracks: dict[str, int] = {}  # track name -> pseudo thread id
        self._notes: dict[Hashable, int] = {}  # pull starts, keyed (block, round)
        self._step: tuple[int, int] | None = None  # (step, start ns) of the step under way

    # -- recording --

    def add(self, name: str, start_ns: int, end_ns: int, track: str | None, args: dict) -> None:
        if track is None:
            tid = self._tids.get(threading.get_ident()) or self._new_thread()
        else:
            tid = self._tracks.get(track) or self._new_track(track)
        self._events.append((name, start_ns, max(end_ns - start_ns, 0), tid, args))
        next(self._appended)

    def note_pull(self, key: Hashable, at_ns: int) -> None:
        """A pull began at ``at_ns`` (its first chunk came); ``take_pull`` reads it once."""
        if len(self._notes) > 4096:  # results no exchange waited for (a failed stream): forget them
            self._notes.clear()
        self._notes[key] = at_ns

    def take_pull(self, key: Hashable, default: int) -> int:
        return self._notes.pop(key, default)

    def begin_step(self, step: int, at_ns: int) -> None:
        """The step's start, kept from its first call until ``end_step``."""
        if self._step is None or self._step[0] != step:
            self._step = (step, at_ns)

    def end_step(self, step: int) -> int | None:
        """The start of ``step`` if it is the step under way (then no step is), else None."""
        if self._step is None or self._step[0] != step:
            return None
        start, self._step = self._step[1], None
        return start

    def _new_thread(self) -> int:
        tid = threading.get_native_id()  # what top and py-spy show
        self._threads[tid] = threading.current_thread().name
        self._tids[threading.get_ident()] = tid
        return tid

    def _new_track(self, track: str) -> int:
        return self._tracks.setdefault(track, _TRACK_BASE + len(self._tracks))

    @property
    def recorded(self) -> int:
        """Events recorded so far, those since pushed out of the ring buffer included."""
        return int(repr(self._appended)[len("count("):-1])  # a count's repr is its next value

    @property
    def dropped(self) -> int:
        """Events pushed out of the ring buffer so far."""
        return max(0, self.recorded - len(self._events))

    # -- output --

    def trace(self) -> dict:
        """The Chrome trace (JSON Object Format): names first, then events by start time, a
        parent before the children starting with it."""
        events = list(self._events)  # one C call: no other thread runs meanwhile
        pid = self.pid
        meta: list[dict] = [
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": self.process_name}},
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": self.sort_index}},
        ]
        for tid, name in sorted(self._threads.items()):
            meta.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
        for i, (track, tid) in enumerate(sorted(self._tracks.items(), key=lambda kv: _natural(kv[0]))):
            meta.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": track}})
            meta.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": 100 + i}})
        events.sort(key=lambda e: (e[1], -e[2]))
        body = [{"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": CATEGORIES.get(name, "cgx-ps"),
                 "ts": start / 1000, "dur": dur / 1000, "args": args}
                for name, start, dur, tid, args in events]
        return {"traceEvents": meta + body, "displayTimeUnit": "ms",
                "otherData": {"process": self.process_name, "clock": "CLOCK_MONOTONIC", "steps": str(self.steps),
                              "max_events": self.max_events, "recorded_events": self.recorded,
                              "dropped_events": self.dropped}}

    def write(self) -> str:
        """Write the trace to ``path`` (whole: a temporary file renamed over it)."""
        tmp = f"{self.path}.{self.pid}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.trace(), f, separators=(",", ":"))
        os.replace(tmp, self.path)
        return self.path


def _natural(name: str) -> list:
    """"block 10" after "block 9"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
