#!/usr/bin/env bash
# The main job (installs .venv first). Extra args go to `cgx-ps demo`, e.g. --compression 2bit.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/cgx-ps demo "$@"
