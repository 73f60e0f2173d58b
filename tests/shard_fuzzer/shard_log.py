"""The shard's log: its lines by level, unformatted lines, tracebacks, and which method each
WARNING-or-worse line is about."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

LOG_LINE = re.compile(r"^\S+ \S+ level=(?P<level>\w+) shard=\S+ pid=\d+ logger=(?P<logger>\S+) msg=(?P<msg>.*)$")
GATE_LINE = re.compile(r"^['\"](?P<method>Register|Exchange|PutBlob|GetBlob|SetCodecs|Probe) (refused|from) ")


@dataclass
class LogStats:
    lines: int = 0
    by_level: Counter = field(default_factory=Counter)
    raw: int = 0  # lines not written by the shard's log formatter (gRPC core, warnings, tracebacks)
    tracebacks: int = 0
    by_method: Counter = field(default_factory=Counter)  # WARNING-or-worse lines, by the method they name
    longest: int = 0

    @property
    def problem_lines(self) -> int:
        """Lines a bad call may cause: anything at WARNING or above, and anything unformatted."""
        return self.raw + sum(n for level, n in self.by_level.items() if level not in ("DEBUG", "INFO"))


def attribute(logger: str, msg: str) -> str:
    """Which method a WARNING-or-worse line is about: the gate names it; the service's own lines
    are about Exchange streams (pushes, readers) and their rounds."""
    gate = GATE_LINE.match(msg)
    if gate:
        return gate["method"]
    if logger in ("cgx_ps.server.rpc.service", "cgx_ps.server.rounds.aggregator"):
        return "Exchange"
    return "other"


def analyse_log(lines: list[str]) -> LogStats:
    stats = LogStats(lines=len(lines))
    for line in lines:
        stats.longest = max(stats.longest, len(line))
        stats.tracebacks += "Traceback (most recent call last)" in line
        m = LOG_LINE.match(line)
        if m is None:
            stats.raw += 1
            stats.by_method["other"] += 1
            continue
        stats.by_level[m["level"]] += 1
        if m["level"] not in ("DEBUG", "INFO"):
            stats.by_method[attribute(m["logger"], m["msg"])] += 1
    return stats
