"""How long chosen tests take on two checkouts, interleaved: ABAB... rounds of one pytest run
each, every run timed by pytest's own --durations (wall seconds of each test's call phase) and
by the CPU seconds of the pytest process and its children. Medians per test and checkout.

    python -m benchmarks.ab_test_time --base /tmp/base --new . --rounds 3 tests/test_status.py

Each checkout runs with its own PYTHONPATH, so its tests import its own cgx_ps.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
from collections import defaultdict

__all__ = ["main", "parse_durations"]

_DURATION = re.compile(r"^([0-9.]+)s call\s+(\S+)$", re.MULTILINE)


def parse_durations(output: str) -> dict[str, float]:
    """Test id -> call seconds, from pytest's ``--durations=0 -vv`` report."""
    return {test: float(seconds) for seconds, test in _DURATION.findall(output)}


def _run(tree: str, tests: list[str]) -> tuple[dict[str, float], float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0", "-vv",
                           "-rf", *tests], cwd=tree, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = proc.stdout.strip().splitlines()
    failed = [line for line in lines if line.startswith("FAILED ")]  # -rf: which, and the first words of why
    summary = "; ".join([lines[-1], *failed]) if lines else proc.stderr[-300:]
    return parse_durations(proc.stdout), cpu, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the checkout to compare against")
    p.add_argument("--new", default=".", help="the checkout under test")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("tests", nargs="+", help="pytest node ids or files, relative to each checkout")
    args = p.parse_args(argv)
    calls: dict[tuple[str, str], list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    for r in range(args.rounds):
        for label, tree in (("base", args.base), ("new", args.new)):
            durations, seconds, summary = _run(tree, args.tests)
            cpu[label].append(seconds)
            for test, s in durations.items():
                calls[test, label].append(s)
            print(f"round {r} {label}: {summary}; {seconds:.1f} CPU s", flush=True)
    print(f"\n{'test':90} {'base s':>8} {'new s':>8}")
    for test in sorted({t for t, _ in calls}):
        base, new = (statistics.median(calls[test, k]) if calls[test, k] else float("nan") for k in ("base", "new"))
        print(f"{test[-90:]:90} {base:8.2f} {new:8.2f}")
    print(f"{'CPU seconds, whole run (median)':90} {statistics.median(cpu['base']):8.1f} "
          f"{statistics.median(cpu['new']):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
