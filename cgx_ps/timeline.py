"""A timeline of where each step's time goes, as a Chrome trace-event file (Perfetto, chrome://tracing).

    CGX_PS_TIMELINE=/tmp/trace.json          workers: each rank writes /tmp/trace.rank<R>.json
    cgx-ps server --timeline /tmp/trace.json     a shard writes /tmp/trace.shard<I>.json
    CGX_PS_TIMELINE_STEPS=10:20              only steps 10..19 (Python slice: "10:", ":5", "7")
    python -m cgx_ps.timeline merged.json /tmp/trace.*.json     one file for Perfetto

What is recorded (``args`` of every span name its step and block):

    worker, training thread   step > backward-ready (copy a block in), exposed wait, write-back, optimizer
    worker, codec threads     encode, decode
    worker, track "block B"   block > reduce (intra-node), push, wait (on the shard), pull
    shard, kernel threads     sum (decode-accumulate one push), re-encode
    shard, track "N/M recv"   receive (one push, first chunk to last), per member M of node N
    shard, track "N/M send"   send (one result)

Tracks are rows of their own (pseudo thread ids): the communication thread's event loop keeps
many blocks in flight at once, whose waits would overlap on one thread's row, while the spans
of one block follow each other. A worker's "step" is the round of its blocks (equal to the
optimizer's step count from 0); a shard's is the round it sums.

Design, and why:

- Off, the instrumented code pays one ``None`` check per call site (plus building its
  arguments): every helper here looks at ``_recorder`` first.
- Timestamps come from ``CLOCK_MONOTONIC`` (``time.monotonic_ns``), one system-wide clock on
  Linux: the files of all workers and shards on a host line up. ``time.perf_counter`` promises
  no common reference point between processes, so it is not used.
- Events go into a ring buffer of ``max_events`` (the newest are kept; the count of those
  dropped is written to ``otherData.dropped_events``), so a forgotten timeline cannot grow a
  long-running process's memory, and the file stays bounded.
- The file is written whole, at ``stop()``: on ``cgx_ps.worker.shutdown()``, at interpreter
  exit, on SIGTERM (a worker with no SIGTERM handler of its own gets one that writes the file
  and then dies of the signal as before) and when a shard stops. It goes to a temporary file
  renamed over the target, so a reader never sees half a file. Chrome's JSON Array Format
  would let a killed process leave a file without its closing bracket, but ``json.load``,
  ``jq`` and Perfetto's importer reject a file cut mid-event, and the drop count belongs at the
  end: a SIGKILLed process (the OOM killer) leaves no timeline.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Hashable, Iterable, Mapping, TypeVar

__all__ = ["DEFAULT_MAX_EVENTS", "ENV_PATH", "ENV_STEPS", "Recorder", "StepRange", "block_track", "load", "mark",
           "merge", "note", "now_ns", "parse_steps", "pulled", "result_sent", "since", "span", "start",
           "start_from_env", "step_begins", "step_ends", "stop", "trace_path", "traced", "wrapped"]

ENV_PATH = "CGX_PS_TIMELINE"
ENV_STEPS = "CGX_PS_TIMELINE_STEPS"
# About 40 MB of memory and 15 MB of JSON at most; ~800 events per step of a 17M-parameter
# model in 4 MB blocks, so the last ~120 steps of a long run.
DEFAULT_MAX_EVENTS = 100_000
_TRACK_BASE = 1 << 24  # pseudo thread ids of tracks: above Linux's largest thread id (pid_max <= 2**22)
# The category of each span name (Perfetto and chrome://tracing filter by it).
CATEGORIES = {"step": "step", "backward-ready": "step", "exposed wait": "step", "write-back": "step",
              "optimizer": "step", "encode": "codec", "decode": "codec", "sum": "codec", "re-encode": "codec",
              "block": "block", "reduce": "intranode", "local sum": "intranode", "push": "network", "wait": "network", "pull": "network",
              "receive": "network", "send": "network"}

log = logging.getLogger(__name__)
T = TypeVar("T")

# The system-wide monotonic clock, in ns: CPython reads it with clock_gettime(CLOCK_MONOTONIC) on
# Linux (mach_absolute_time on macOS, QueryPerformanceCounter on Windows, system-wide as well),
# and calls it directly, where time.clock_gettime_ns(CLOCK_MONOTONIC) parses its argument first
# (a test checks that both read the same clock).
now_ns = time.monotonic_ns


# ---- configuration: which steps, which file ----------------------------------------------------

@dataclass(frozen=True)
class StepRange:
    """Steps ``start`` .. ``stop - 1`` (``stop`` None: no end), as a Python slice."""

    start: int = 0
    stop: int | None = None

    def __contains__(self, step: int) -> bool:
        return self.start <= step and (self.stop is None or step < self.stop)

    def __str__(self) -> str:
        return f"{self.start}:{'' if self.stop is None else self.stop}"


_STEPS = re.compile(r"^\s*(\d*)\s*(:?)\s*(\d*)\s*$")


def parse_steps(text: str, source: str = ENV_STEPS, error: type[Exception] = ValueError) -> StepRange:
    """``"a:b"`` (steps a..b-1), ``"a:"``, ``":b"``, ``"a"`` (step a alone) or ``""`` (all);
    raises ``error`` naming ``source`` for anything else."""
    m = _STEPS.match(text or "")
    if m is None:
        raise error(f"{source}={text!r} is not a step range: write a:b for steps a..b-1 "
                    f"(a: or :b leave a side open; one number is one step)")
    first, colon, last = m.groups()
    start = int(first) if first else 0
    stop = (int(last) if last else None) if colon else (start + 1 if first else None)
    if stop is not None and stop <= start:
        raise error(f"{source}={text!r} selects no step: the end ({stop}) must be above the start ({start})")
    return StepRange(start, stop)


def trace_path(template: str, role: str, index: int) -> str:
    """Where a process writes: ``trace.json`` -> ``trace.rank3.json`` (role "rank") or
    ``trace.shard1.json``. Every rank of a torchrun job gets the same environment, and a shell
    that exports the variable starts shards and workers alike: the role and index in the name
    keep their files apart whatever the world size."""
    path = Path(template)
    suffix = path.suffix or ".json"
    return str(path.with_name(f"{path.name[:len(path.name) - len(path.suffix)]}.{role}{index}{suffix}"))


# ---- the recorder ------------------------------------------------------------------------------

class Recorder:
    """The events of one process, in a ring buffer, written as one Chrome trace file."""

    def __init__(self, path: str, process_name: str, sort_index: int = 0, steps: StepRange = StepRange(),
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


class _Span:
    __slots__ = ("_rec", "_name", "_track", "_args", "_start")

    def __init__(self, rec: Recorder, name: str, track: str | None, args: dict) -> None:
        self._rec, self._name, self._track, self._args = rec, name, track, args

    def __enter__(self) -> None:
        self._start = now_ns()

    def __exit__(self, *exc: object) -> None:
        self._rec.add(self._name, self._start, now_ns(), self._track, self._args)


class _Off:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()

# ---- what instrumented code calls --------------------------------------------------------------

_recorder: Recorder | None = None
_lock = threading.Lock()
_atexit_registered = False


def block_track(block_id: int) -> str:
    return f"block {block_id}"


def _on(step: int) -> Recorder | None:
    rec = _recorder
    return rec if rec is not None and step in rec.steps else None


def span(name: str, step: int, track: str | None = None, **args: Any):
    """``with span("encode", step, block=3):`` records the body as one span, on this thread's
    row (``track`` None) or on a track's."""
    rec = _recorder
    if rec is None or step not in rec.steps:
        return _OFF
    args["step"] = step
    return _Span(rec, name, track, args)


def mark() -> int | None:
    """Now, when recording (for ``since``); None otherwise."""
    return None if _recorder is None else now_ns()


def since(start: int | None, name: str, step: int, track: str | None = None, **args: Any) -> None:
    """A span from ``start`` (a ``mark()``) to now."""
    rec = _recorder
    if start is None or rec is None or step not in rec.steps:
        return
    args["step"] = step
    rec.add(name, start, now_ns(), track, args)


def traced(work: Awaitable[T], name: str, step: int, track: str, **args: Any) -> Awaitable[T]:
    """A coroutine as one span on a track, from its first to its last instruction (the
    coroutine itself when not recording)."""
    rec = _on(step)
    if rec is None:
        return work
    args["step"] = step

    async def run() -> T:
        start = now_ns()
        try:
            return await work
        finally:
            rec.add(name, start, now_ns(), track, args)

    return run()


def wrapped(fn: Callable[..., T], name: str, step: int, **args: Any) -> Callable[..., T]:
    """``fn`` recording each call as a span on the thread that runs it (an executor's)."""
    rec = _on(step)
    if rec is None:
        return fn
    args["step"] = step

    def run(*a: Any, **kw: Any) -> T:
        with _Span(rec, name, None, args):
            return fn(*a, **kw)

    return run


def note(block_id: int, round_: int) -> None:
    """The first chunk of a block's result arrived (the worker's stream reader): its pull begins."""
    rec = _on(round_)
    if rec is not None:
        if len(rec._notes) > 4096:  # results no exchange waited for (a failed stream): forget them
            rec._notes.clear()
        rec._notes[(block_id, round_)] = now_ns()


def pulled(pushed: int | None, block_id: int, round_: int) -> None:
    """The result is in: "wait" from the end of the push (``pushed``, a ``mark()``) to its first
    chunk, "pull" from there to now, on the block's track."""
    rec = _on(round_)
    if rec is None or pushed is None:
        return
    end = now_ns()
    # the first chunk can arrive before the coroutine that pushed resumes: then no wait
    first = min(max(rec._notes.pop((block_id, round_), pushed), pushed), end)
    track = block_track(block_id)
    rec.add("wait", pushed, first, track, {"block": block_id, "step": round_})
    rec.add("pull", first, end, track, {"block": block_id, "step": round_})


def result_sent(start: int | None, block_id: int, round_: int, nbytes: int, node_id: str, member: int) -> None:
    """A shard wrote the result of (block, round), ``nbytes`` long, to a member's stream."""
    rec = _recorder
    if start is not None and rec is not None and round_ in rec.steps:
        rec.add("send", start, now_ns(), f"{node_id}/{member} send",
                {"block": block_id, "step": round_, "bytes": nbytes})


def step_begins(step: int) -> None:
    """The step's first block is handed over (the front end calls this before "backward-ready")."""
    rec = _on(step)
    if rec is not None and (rec._step is None or rec._step[0] != step):
        rec._step = (step, now_ns())


def step_ends(step: int, **args: Any) -> None:
    """The optimizer stepped: "step" from ``step_begins`` to now, on this thread's row."""
    rec = _on(step)
    if rec is not None and rec._step is not None and rec._step[0] == step:
        args["step"] = step
        rec.add("step", rec._step[1], now_ns(), None, args)
        rec._step = None


# ---- starting and stopping ---------------------------------------------------------------------

def start(recorder: Recorder, *, handle_sigterm: bool = False) -> Recorder:
    """Record into ``recorder`` from now on (one per process: a second start keeps the first).
    Writes at ``stop()`` and at interpreter exit; ``handle_sigterm``: also on SIGTERM, when the
    program has no handler of its own."""
    global _recorder, _atexit_registered
    with _lock:
        if _recorder is not None:
            return _recorder
        _recorder = recorder
        if not _atexit_registered:
            atexit.register(stop)
            _atexit_registered = True
    if handle_sigterm and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _write_and_die)
    log.info("timeline: recording steps %s into %s", recorder.steps, recorder.path)
    return recorder


def stop(recorder: Recorder | None = None, write: bool = True) -> str | None:
    """Stop recording and write the file (only if ``recorder`` is the one recording, when
    given; ``write`` False: only stop, as a benchmark pausing it does); its path, or None when
    nothing was written."""
    global _recorder
    # no lock: a SIGTERM handler calls this, and the thread it interrupted may hold any lock
    rec = _recorder
    if rec is None or (recorder is not None and rec is not recorder):
        return None
    _recorder = None
    if not write:
        return None
    try:
        return rec.write()
    except OSError as exc:  # at exit: say so, do not turn a finished run into a failed one
        log.warning("timeline: cannot write %s: %s", rec.path, exc)
        return None


def _write_and_die(signum: int, frame: object) -> None:
    stop()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the signal, as without us (torchrun reads the cause)


def start_from_env(env: Mapping[str, str], role: str, index: int, process_name: str, sort_index: int = 0,
                   error: type[Exception] = ValueError, **options: Any) -> Recorder | None:
    """Start recording when ``CGX_PS_TIMELINE`` is set (workers). Raises ``error`` naming a
    bad step range or a directory that does not exist, at start and not at exit."""
    template = env.get(ENV_PATH, "").strip()
    if not template:
        return None
    steps = parse_steps(env.get(ENV_STEPS, ""), ENV_STEPS, error)
    return start(recorder_for(template, role, index, process_name, sort_index, steps, ENV_PATH, error),
                 **options)


def start_shard(template: str | None, steps: str, shard_index: int, num_shards: int) -> Recorder | None:
    """Start recording when ``--timeline`` is set (shards); OSError for a folder that does not
    exist (the shard's start-up reports it in one line)."""
    if not template:
        return None
    return start(recorder_for(template, "shard", shard_index, f"shard {shard_index} of {num_shards}",
                              1000 + shard_index, parse_steps(steps, "--timeline-steps"), "--timeline", OSError))


def recorder_for(template: str, role: str, index: int, process_name: str, sort_index: int, steps: StepRange,
                 source: str, error: type[Exception] = ValueError) -> Recorder:
    path = trace_path(template, role, index)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise error(f"{source}={template!r}: cannot write the timeline into {folder} (not a writable directory)")
    return Recorder(path, process_name, sort_index, steps)


# ---- reading and merging -----------------------------------------------------------------------

def load(path: str) -> dict:
    with open(path) as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace in JSON Object Format (no traceEvents list)")
    return trace


def merge(traces: Iterable[dict]) -> dict:
    """The traces of several processes of one host as one (their clock is the same; their pids
    differ)."""
    events, other = [], {}
    for trace in traces:
        events += trace["traceEvents"]
        data = trace.get("otherData", {})
        other[data.get("process", f"trace {len(other)}")] = data
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m cgx_ps.timeline MERGED.json TRACE.json...   (one file for Perfetto)", file=sys.stderr)
        return 2
    merged = merge(load(p) for p in args[1:])
    with open(args[0], "w") as f:
        json.dump(merged, f, separators=(",", ":"))
    print(f"{args[0]}: {len(merged['traceEvents'])} events from {len(args) - 1} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
