#!/usr/bin/env bash
# Run the test suite (installs .venv first). Extra args go to pytest, e.g. -k codec.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"
