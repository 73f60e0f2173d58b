#!/usr/bin/env bash
# Build the cgx-ps image where no registry or package index can be reached: a Debian base made
# from Debian's packages (deploy/build-base.sh), every wheel downloaded beforehand
# (deploy/build-wheelhouse.sh), and `docker build` with --build-arg PIP_NO_INDEX=1.
#
#   deploy/build-offline.sh [--gpu] [TAG] [docker build options...]
#       TAG defaults to cgx-ps:0.1.0 (cgx-ps-gpu:0.1.0 with --gpu)
#
# The build context is staged in a temporary directory from the paths the Dockerfile's
# .dockerignore allows, plus the wheels: this works with the classic builder too, which would
# otherwise send the whole checkout (its .venv included). Needs root for the first
# build-base.sh run; later runs reuse the base image and the wheelhouse under CGX_PS_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."
dockerfile=Dockerfile gpu=""
if [ "${1:-}" = --gpu ]; then dockerfile=Dockerfile.gpu gpu=--gpu; shift; fi
tag=${1:-$([ -n "$gpu" ] && echo cgx-ps-gpu:0.1.0 || echo cgx-ps:0.1.0)}
shift || true
base=${CGX_PS_BASE_IMAGE:-cgx-ps-base:bookworm}
wheels=${CGX_PS_CACHE:-/var/cache/cgx-ps}/wheelhouse${gpu:+-cuda12}

deploy/build-base.sh "$base"
deploy/build-wheelhouse.sh $gpu "$wheels"

ctx=$(mktemp -d "${TMPDIR:-/tmp}/cgx-ps-context.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
mapfile -t allowed < <(sed -n 's/^!//p' "deploy/$dockerfile.dockerignore")
tar -c --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' --exclude='*.whl' \
  "${allowed[@]}" "deploy/$dockerfile" | tar -x -C "$ctx"
# Hard links when the cache shares a file system with the context: 300 MB not copied.
cp -l "$wheels"/*.whl "$ctx/deploy/wheelhouse/" 2>/dev/null || cp "$wheels"/*.whl "$ctx/deploy/wheelhouse/"

if [ -n "$gpu" ]; then
  # The CUDA base image would come from a registry; on the Debian base the image builds and
  # installs CuPy, but has no CUDA runtime (see docs/deploy.md). torch is the local CPU build.
  set -- --build-arg CUDA_IMAGE="$base" --build-arg TORCH_VERSION=2.13.0 "$@"
else
  set -- --build-arg PYTHON_IMAGE="$base" "$@"
fi
docker build -f "$ctx/deploy/$dockerfile" --build-arg PIP_NO_INDEX=1 -t "$tag" "$@" "$ctx"
