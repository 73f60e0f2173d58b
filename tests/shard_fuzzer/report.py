"""The report of a fuzz run: what the calls ended with, the shard's state afterwards, the checks
the run must pass, and its summary."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from .calls import Outcome
from .cases import Case
from .settings import (CONCURRENCY, DETAILS_LIMIT, KINDS, MAX_INFLIGHT_MB, MAX_MESSAGE, METHODS, RSS_ALLOWANCE_MIB,
                       RSS_SLACK_MIB)
from .shard_log import LogStats

@dataclass
class FuzzReport:
    cases: int
    seed: int
    mode: str = "subprocess"
    seconds: float = 0.0  # the fuzz calls alone
    codes: Counter = field(default_factory=Counter)  # status code -> calls
    by_method: dict[str, Counter] = field(default_factory=lambda: {m: Counter() for m in METHODS})
    by_kind: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    by_style: Counter = field(default_factory=Counter)
    scenarios_run: set[str] = field(default_factory=set)
    bad_calls: Counter = field(default_factory=Counter)  # method -> calls that did not end OK
    oversized_details: int = 0  # statuses that were (or would have been) too large to deliver
    fuzzer_errors: int = 0  # exceptions in the fuzzer itself, or calls that outlived their deadline
    alarms: list[str] = field(default_factory=list)  # one line per alarming call (the first 20)
    alarm_kinds: Counter = field(default_factory=Counter)  # "method: code: details" (digits as N) -> calls
    register_failures: Counter = field(default_factory=Counter)  # the members' own Registers
    members_not_joined: int = 0  # member cases whose Register failed (they ran as strangers)
    log: LogStats = field(default_factory=LogStats)  # the fuzz phase only
    rss_start_kib: int = 0
    rss_peak_kib: int = 0
    rss_end_kib: int = 0
    rss_bound_kib: int = 0
    rss_quarter_peaks_kib: list[int] = field(default_factory=list)
    health_worst_s: float = 0.0  # the slowest health check during the fuzz
    alive: bool = False
    serving: bool = False
    exchange_before: str | None = "not run"  # None: the legitimate 2-node round worked
    exchange_after: str | None = "not run"
    exit_code: int | None = None  # after SIGTERM, at the end

    @property
    def total_bad_calls(self) -> int:
        return sum(self.bad_calls.values())

    def record(self, case: Case, scenario_name: str, outcome: Outcome) -> None:
        self.codes[outcome.code] += 1
        self.by_method[case.method][outcome.code] += 1
        self.by_kind[case.kind][outcome.code] += 1
        self.by_style[case.style] += 1
        if scenario_name:
            self.scenarios_run.add(scenario_name)
        if outcome.code != "OK":
            self.bad_calls[case.method] += 1
        oversized = len(outcome.details) > DETAILS_LIMIT or "metadata size exceeds" in outcome.details
        self.oversized_details += oversized
        if outcome.code in ("INTERNAL", "UNKNOWN") or oversized:
            self.alarm(case, scenario_name, f"{outcome.code}: {outcome.details[:200]!r} ({len(outcome.details)} chars)")

    def alarm(self, case: Case, scenario_name: str, text: str) -> None:
        self.alarm_kinds[re.sub(r"\d+", "N", f"{case.method}: {text}")[:110]] += 1
        if len(self.alarms) < 20:
            self.alarms.append(f"case {case.index} {case.method}/{case.kind}/{case.style}"
                               f"{'/' + scenario_name if scenario_name else ''}: {text}")

    def checks(self) -> dict[str, str | None]:
        """Each property the fuzz run must leave true: None when it holds, else why not."""
        lines_over = {m: (n, self.bad_calls[m]) for m, n in self.log.by_method.items()
                      if m != "other" and n > self.bad_calls[m]}
        return {
            "alive": None if self.alive else "the shard process died",
            "serving": None if self.serving else "the health service does not say SERVING",
            "warm-up": self.exchange_before and f"a 2-node round failed before the fuzz: {self.exchange_before}",
            "exchange": self.exchange_after and f"a legitimate 2-node round failed afterwards: {self.exchange_after}",
            "rss": None if self.rss_peak_kib <= self.rss_bound_kib else
            f"peak RSS {self.rss_peak_kib} KiB over the bound of {self.rss_bound_kib} KiB",
            "log_lines": None if self.log.problem_lines <= self.total_bad_calls and not lines_over else
            f"{self.log.problem_lines} WARNING-or-worse lines for {self.total_bad_calls} bad calls; per method "
            f"(lines, bad calls) over: {lines_over}",
            "tracebacks": None if self.log.tracebacks == 0 else f"{self.log.tracebacks} tracebacks in the log",
            "unknown": None if self.codes["UNKNOWN"] == 0 else f"{self.codes['UNKNOWN']} calls ended UNKNOWN",
            "internal": None if self.codes["INTERNAL"] == 0 else f"{self.codes['INTERNAL']} calls ended INTERNAL",
            "details": None if self.oversized_details == 0 else
            f"{self.oversized_details} statuses were too large to deliver (the shard echoed the request)",
            "fuzzer": None if self.fuzzer_errors == 0 else f"{self.fuzzer_errors} fuzzer errors or hung calls",
        }

    def problems(self) -> list[str]:
        return [f"{name}: {why}" for name, why in self.checks().items() if why]

    def summary(self) -> str:
        mib = lambda kib: f"{kib / 1024:.0f} MiB"  # noqa: E731
        out = [
            f"shard_fuzzer: {self.cases} cases, seed {self.seed}, shard {self.mode}, {self.seconds:.1f} s "
            f"({self.cases / max(self.seconds, 1e-9):.0f} calls/s, {CONCURRENCY} at a time)",
            f"  status codes: {dict(self.codes.most_common())}",
            *(f"    {m:<10} {dict(c.most_common())}" for m, c in self.by_method.items()),
            *(f"    {k:<12} {dict(c.most_common())}" for k, c in self.by_kind.items()),
            f"  styles: {dict(self.by_style)}; protocol scenarios run: {len(self.scenarios_run)}",
            f"  bad calls (not OK): {self.total_bad_calls} {dict(self.bad_calls)}",
            f"  shard log during the fuzz: {self.log.lines} lines {dict(self.log.by_level)}, {self.log.raw} raw, "
            f"{self.log.tracebacks} tracebacks, longest {self.log.longest} chars; WARNING-or-worse by method "
            f"{dict(self.log.by_method)}",
            f"  RSS: start {mib(self.rss_start_kib)}, peak {mib(self.rss_peak_kib)}, end {mib(self.rss_end_kib)}, "
            f"bound {mib(self.rss_bound_kib)} (start + {RSS_ALLOWANCE_MIB} MiB: 3 x {MAX_INFLIGHT_MB} MiB in flight, "
            f"2 x {CONCURRENCY} messages of {MAX_MESSAGE >> 20} MiB, {RSS_SLACK_MIB} MiB slack); peak per quarter of "
            f"the run {', '.join(mib(k) for k in self.rss_quarter_peaks_kib)}",
            f"  slowest health check during the fuzz: {self.health_worst_s:.2f} s",
            f"  alive {self.alive}, SERVING {self.serving}, 2-node round before: {self.exchange_before or 'ok'}, "
            f"after: {self.exchange_after or 'ok'}, exit status after SIGTERM {self.exit_code}",
            f"  members' own Registers refused: {dict(self.register_failures) or 0}; member cases that ran "
            f"without a membership: {self.members_not_joined}",
            *(f"  alarms: {n:>4} x {kind}" for kind, n in self.alarm_kinds.most_common()),
            *(f"  alarm: {a}" for a in self.alarms),
        ]
        problems = self.problems()
        out.append("  PROBLEMS:\n    " + "\n    ".join(problems) if problems else "  all checks passed")
        return "\n".join(out)
