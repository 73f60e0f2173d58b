"""A timeline of where each step's time goes, as a Chrome trace-event file (Perfetto, chrome://tracing).

    CGX_PS_TIMELINE=/tmp/trace.json          workers: each rank writes /tmp/trace.rank<R>.json
    cgx-ps server --timeline /tmp/trace.json     a shard writes /tmp/trace.shard<I>.json
    CGX_PS_TIMELINE_STEPS=10:20              only steps 10..19 (Python slice: "10:", ":5", "7")
    python -m cgx_ps.timeline merged.json /tmp/trace.*.json     one file for Perfetto

What is recorded (``args`` of every span name its step and block):

    worker, training thread   step > backward-ready (copy a block in), exposed wait, write-back, optimizer
    worker, codec threads     encode, decode
    worker, track "block B"   block > reduce (intra-node), push, wait (on the shard), pull
    shard, kernel threads     sum (check and keep one push), re-encode (sum the round, encode once)
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

The jobs, one module each: ``config`` (which steps, which file), ``recorder`` (the ring buffer
and the file it writes), ``spans`` (what instrumented code calls; start and stop), ``merge``
(reading and merging traces; the command above).
"""

from __future__ import annotations

from .config import ENV_PATH, ENV_STEPS, StepRange, parse_steps, trace_path
from .merge import load, merge
from .recorder import DEFAULT_MAX_EVENTS, Recorder, now_ns
from .spans import (block_track, mark, note, pulled, result_sent, since, span, start, start_from_env, step_begins,
                    step_ends, stop, traced, wrapped)
# reached as timeline.X though not public API: the shard's start (server/main.py), the command's entry
from .merge import main  # noqa: F401, E402
from .recorder import CATEGORIES  # noqa: F401, E402
from .spans import recorder_for, start_shard  # noqa: F401, E402

__all__ = ["DEFAULT_MAX_EVENTS", "ENV_PATH", "ENV_STEPS", "Recorder", "StepRange", "block_track", "load", "mark",
           "merge", "note", "now_ns", "parse_steps", "pulled", "result_sent", "since", "span", "start",
           "start_from_env", "step_begins", "step_ends", "stop", "trace_path", "traced", "wrapped"]
