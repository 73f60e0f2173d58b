"""Every benchmark script runs the way BENCHMARKS.md shows it, `python benchmarks/X.py ...` from the
checkout's root with no PYTHONPATH: `--help` prints its usage, without a traceback. (server.py,
dataplane.py, linkprobe.py and grad_memory.py could not import their own package that way.)

One interpreter runs every script in turn (``HELP_ALL``), as ``python benchmarks/X.py --help``
would: sys.argv and sys.path[0] (the script's folder, not the root) set as Python sets them, and
every module imported from the checkout's ``benchmarks`` folder forgotten between scripts, so a
script that cannot import its own package fails here as it would alone. Only what is installed
(torch, numpy, cgx_ps) stays loaded: importing torch afresh for each of 40-odd scripts took a
minute of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if '__name__ == "__main__"' in p.read_text())

HELP_ALL = r"""
import contextlib, io, json, runpy, sys, traceback
from pathlib import Path
root = Path.cwd().resolve()
path, results = list(sys.path[1:]), {}
for script in sys.argv[1:]:
    before = set(sys.modules)
    sys.argv, sys.path[:] = [script, "--help"], [str((root / script).parent)] + path
    out, code = io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    results[script] = [code, out.getvalue()]
    for name in set(sys.modules) - before:  # the checkout's own benchmark modules, not installed packages
        where = getattr(sys.modules[name], "__file__", None) or ""
        if name == "benchmarks" or name.startswith("benchmarks.") or Path(where).parent == root / "benchmarks":
            del sys.modules[name]
sys.stdout.write(json.dumps(results))
"""


def test_every_benchmark_script_answers_help_without_pythonpath() -> None:
    assert len(SCRIPTS) > 20, SCRIPTS  # the glob found the scripts
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    names = [str(s.relative_to(ROOT)) for s in SCRIPTS]
    run = subprocess.run([sys.executable, "-c", HELP_ALL, *names], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout)
    assert sorted(results) == sorted(names)
    broken = [f"{name}: exit {code}\n{text[-800:]}" for name, (code, text) in results.items()
              if code not in (0, 2) or "Traceback" in text or "usage" not in text.lower()]
    assert not broken, "\n\n".join(broken)
