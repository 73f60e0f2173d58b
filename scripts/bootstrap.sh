#!/usr/bin/env bash
# Create ./.venv with cgx-ps and its dev tools. Idempotent; safe to re-run.
# torch is installed first as a pinned CPU build: a bare "torch" requirement would pull
# a multi-GB CUDA build on a machine that has none installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${CGX_PS_TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.cgx-ps-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "$TORCH_SPEC"
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
