"""Reading traces and merging those of one host into one file: ``python -m cgx_ps.timeline``."""

from __future__ import annotations

import json
import sys
from typing import Iterable

__all__ = ["load", "main", "merge"]


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
