#!/usr/bin/env bash
# Download every wheel deploy/Dockerfile installs into one directory, for a build that reaches
# no index (--build-arg PIP_NO_INDEX=1; deploy/build-offline.sh does both):
#
#   deploy/build-wheelhouse.sh [--gpu] [DIR]     # default DIR: $CGX_PS_CACHE/wheelhouse
#
# The wheels are for CPython $PYTHON_VERSION (default 3.11, the CPU image's Python; 3.12 for the
# CUDA base of deploy/Dockerfile.gpu) on this machine's architecture, at
# the versions deploy/constraints.txt pins. pip runs with this machine's configuration, so a
# torch build found through its find-links or indexes (`pip config list`) is taken first;
# otherwise torch comes from TORCH_INDEX_URL (the PyTorch CPU index). --gpu adds CuPy
# (cgx-ps[cuda12]) for deploy/Dockerfile.gpu. Does nothing when DIR already holds the wheels for
# the current constraints.txt, dependencies and options.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
if [ "${1:-}" = --gpu ]; then extra=cuda12; shift; fi
dir=${1:-${CGX_PS_CACHE:-/var/cache/cgx-ps}/wheelhouse${extra:+-$extra}}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
torch_index=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
py=${PYTHON:-python3}
pyver=${PYTHON_VERSION:-3.11}

# The runtime requirements, read from pyproject.toml so that this list is never written twice.
mapfile -t reqs < <("$py" - "$extra" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extra = sys.argv[1]
for req in project["dependencies"] + (project["optional-dependencies"][extra] if extra else []):
    print(req)
PY
)
# setuptools and wheel: the build backend pip needs to install cgx-ps from its source tree.
reqs+=(setuptools wheel)
key=$(printf '%s\n' "$pyver" "$torch_spec" "${reqs[@]}" | cat - deploy/constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$dir/.complete" 2>/dev/null)" = "$key" ]; then
  echo "build-wheelhouse: $dir is up to date" >&2
  exit 0
fi
mkdir -p "$dir"
rm -f "$dir/.complete"
download() {
  "$py" -m pip download --quiet --dest "$dir" --python-version "$pyver" --only-binary=:all: \
    --constraint deploy/constraints.txt "$@"
}
echo "build-wheelhouse: downloading into $dir..." >&2
download --no-deps "$torch_spec" 2>/dev/null \
  || download --no-deps --extra-index-url "$torch_index" "$torch_spec"
download "$torch_spec" "${reqs[@]}"
echo "$key" >"$dir/.complete"
echo "build-wheelhouse: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir" >&2
