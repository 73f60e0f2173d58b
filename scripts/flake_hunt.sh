#!/usr/bin/env bash
# Run tests many times under CPU load, to expose the ones whose outcome depends on timing:
#   scripts/flake_hunt.sh COUNT HOGS TEST...      e.g. scripts/flake_hunt.sh 20 2 tests/test_resilience.py::test_x
# COUNT runs of each TEST while HOGS busy loops (`yes`) compete for the cores; every run is
# reported (no -x), with the slowest durations. Never the whole suite: pick the suspects.
set -euo pipefail
cd "$(dirname "$0")/.."
count=$1 hogs=$2
shift 2
python=${PYTHON:-.venv/bin/python}
hog_pids=()
stop_hogs() { for p in "${hog_pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop_hogs EXIT
for _ in $(seq 1 "$hogs"); do
  yes >/dev/null &
  hog_pids+=($!)
done
PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pytest -q -p pytest_repeat -p no:cacheprovider \
  --count "$count" --durations=10 -rf "$@"
