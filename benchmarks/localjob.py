"""Worker processes on this host (loopback): one per rank, each answering with one JSON line.

The loopback benchmarks (``worker.py``, ``timeline.py``) start their ranks the same way; the
emulated cluster's runner (``benchmarks.jobs``) reads its hosts' answers with ``last_json_line``.
"""

from __future__ import annotations

import json
import subprocess
from typing import Callable, Mapping, Sequence

__all__ = ["last_json_line", "run_ranks"]


def last_json_line(text: str) -> dict | None:
    """The last line of ``text`` that parses as a JSON object (a worker's result), or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_ranks(argv: Sequence[str], world: int, env_for: Callable[[int], Mapping[str, str]],
              timeout: float = 900.0) -> list[dict]:
    """Run ``argv`` once per rank 0..world-1 with the whole environment ``env_for(rank)``, all at
    once (they train together), and return each rank's result line; a rank that fails or answers
    nothing raises RuntimeError with the end of its stderr."""
    procs = [subprocess.Popen([str(a) for a in argv], env=dict(env_for(rank)), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(world)]
    results = []
    try:
        for rank, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=timeout)
            result = last_json_line(stdout)
            if proc.returncode or result is None:
                raise RuntimeError(f"rank {rank} of {' '.join(map(str, argv[:2]))} failed "
                                   f"(rc {proc.returncode}):\n{stderr[-3000:]}")
            results.append(result)
    finally:
        for proc in procs:  # one rank failing leaves its peers waiting for it forever
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results
