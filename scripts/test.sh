#!/usr/bin/env bash
# Run the test suite (installs .venv first). Extra args go to pytest, e.g. -k codec.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# numba compiles every width's kernels once here (1-1.5 min cold), so the tests' processes load them
.venv/bin/python -m cgx_ps.kernels.warm
# -n: one pytest process per core (pytest-xdist; CGX_PS_TEST_WORKERS=0 runs them in this one),
# each test file on one of them (--dist loadfile), so a file's module-scoped shards start once.
# Most tests wait on processes they start; two at a time keep 2 cores busy (~10 min on 2 cores). The
# worker processes they start are forked from a process that imported torch once
# (tests/workers/warm_start.py; CGX_PS_TEST_WARM_START=0 starts each fresh).
# --durations: the slowest tests, so a CI log shows where the time budget goes.
exec .venv/bin/python -m pytest -q -n "${CGX_PS_TEST_WORKERS:-auto}" --dist loadfile --durations=15 "$@"
