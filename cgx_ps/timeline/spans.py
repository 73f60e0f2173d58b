"""What instrumented code calls: spans and step markers into the process's one recorder, and
starting and stopping it (from the environment for workers, from flags for shards).

Off, the instrumented code pays one ``None`` check per call site (plus building its arguments):
every helper here looks at ``_recorder`` first.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from typing import Any, Awaitable, Callable, Mapping, TypeVar

from .config import ENV_PATH, ENV_STEPS, StepRange, parse_steps, trace_path
from .recorder import Recorder, now_ns

__all__ = ["block_track", "mark", "note", "pulled", "recorder_for", "result_sent", "since", "span", "start",
           "start_from_env", "start_shard", "step_begins", "step_ends", "stop", "traced", "wrapped"]

log = logging.getLogger("cgx_ps.timeline")
T = TypeVar("T")


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
        rec.note_pull((block_id, round_), now_ns())


def pulled(pushed: int | None, block_id: int, round_: int) -> None:
    """The result is in: "wait" from the end of the push (``pushed``, a ``mark()``) to its first
    chunk, "pull" from there to now, on the block's track."""
    rec = _on(round_)
    if rec is None or pushed is None:
        return
    end = now_ns()
    # the first chunk can arrive before the coroutine that pushed resumes: then no wait
    first = min(max(rec.take_pull((block_id, round_), pushed), pushed), end)
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
    if rec is not None:
        rec.begin_step(step, now_ns())


def step_ends(step: int, **args: Any) -> None:
    """The optimizer stepped: "step" from ``step_begins`` to now, on this thread's row."""
    rec = _on(step)
    start = rec.end_step(step) if rec is not None else None
    if start is not None:
        args["step"] = step
        rec.add("step", start, now_ns(), None, args)


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


