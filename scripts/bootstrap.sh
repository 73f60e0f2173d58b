#!/usr/bin/env bash
# Create ./.venv with cgx-ps and its dev tools. Idempotent: re-installs only when pyproject.toml
# changed. torch is installed first as a pinned CPU build: a bare "torch" requirement would
# pull a multi-GB CUDA build on a machine that has none installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${CGX_PS_TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.cgx-ps-installed
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then
  exit 0
fi
echo "cgx-ps: installing into .venv (first run only; log in .venv/install.log)..." >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=.venv/install.log
if ! {
  .venv/bin/python -m pip install --upgrade pip &&
  { .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install "$TORCH_SPEC"; } &&
  .venv/bin/python -m pip install -e ".[dev]"
} >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "cgx-ps: installation failed; full log in $log" >&2
  exit 1
fi
touch "$stamp"
