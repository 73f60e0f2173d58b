"""Every benchmark script runs the way BENCHMARKS.md shows it, `python benchmarks/X.py ...` from the
checkout's root with no PYTHONPATH: `--help` prints its usage, without a traceback. (server.py,
dataplane.py, linkprobe.py and grad_memory.py could not import their own package that way.)"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if '__name__ == "__main__"' in p.read_text())


def _help(script: Path) -> tuple[Path, subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return script, subprocess.run([sys.executable, str(script.relative_to(ROOT)), "--help"], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=120)


def test_every_benchmark_script_answers_help_without_pythonpath() -> None:
    assert len(SCRIPTS) > 20, SCRIPTS  # the glob found the scripts
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(_help, SCRIPTS))
    broken = [f"{s.name}: exit {r.returncode}\n{(r.stdout + r.stderr)[-800:]}" for s, r in runs
              if r.returncode not in (0, 2) or "Traceback" in r.stdout + r.stderr
              or "usage" not in (r.stdout + r.stderr).lower()]
    assert not broken, "\n\n".join(broken)
