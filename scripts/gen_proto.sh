#!/usr/bin/env bash
# Regenerate the committed protocol code (cgx_ps/v1/*_pb2*.py) from protos/.
# tests/test_proto.py fails when the committed files differ from a fresh generation.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.}
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -Iprotos --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" protos/cgx_ps/v1/ps.proto
