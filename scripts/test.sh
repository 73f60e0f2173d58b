#!/usr/bin/env bash
# Run the test suite (installs .venv first). Extra args go to pytest, e.g. -k codec.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# numba compiles every width's kernels once here (1-1.5 min cold), so the tests' processes load them
.venv/bin/python -m cgx_ps.kernels.warm
# --durations: the slowest tests, so a CI log shows where the time budget goes
exec .venv/bin/python -m pytest -q --durations=15 "$@"
