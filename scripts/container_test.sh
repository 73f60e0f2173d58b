#!/usr/bin/env bash
# The container test: build the CPU image offline (deploy/build-offline.sh) and run
# tests/test_container.py against it (2 shard and 2 worker containers on a user-defined network).
# .ci/run calls this after the suite. Where Docker cannot run, it prints one line saying why,
# "container test skipped: ...", and exits 0.
#
# As root on Debian it installs what is missing (docker.io, debootstrap) and starts dockerd when
# no daemon answers, stopping it again at exit. The base image's root filesystem and the
# wheelhouse stay under CGX_PS_CACHE (default /var/cache/cgx-ps), the image's layers in Docker's
# store, so a second run on the same machine rebuilds only what changed.
# CGX_PS_SKIP_CONTAINER_TEST=1 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
skip() {
  echo "container test skipped: $*" >&2
  exit 0
}
[ "${CGX_PS_SKIP_CONTAINER_TEST:-0}" = 1 ] && skip "CGX_PS_SKIP_CONTAINER_TEST=1"
cache=${CGX_PS_CACHE:-/var/cache/cgx-ps}
export CGX_PS_CACHE=$cache
tag=cgx-ps:container-test
began=$SECONDS
elapsed() { echo "container test: $1 at $((SECONDS - began)) s" >&2; }

missing=()
# docker.io: the daemon, unless one already answers (a docker command alone is not enough)
if ! docker info >/dev/null 2>&1 && ! command -v dockerd >/dev/null; then missing+=(docker.io); fi
docker image inspect cgx-ps-base:bookworm >/dev/null 2>&1 || [ -s "$cache/rootfs-bookworm-python3.tar" ] \
  || command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    || skip "${missing[*]} not installed, and installing needs root and apt-get"
  echo "container test: installing ${missing[*]}..." >&2
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; } \
    >/tmp/cgx-ps-container-test-apt.log 2>&1 \
    || skip "apt-get install ${missing[*]} failed (log: /tmp/cgx-ps-container-test-apt.log)"
  elapsed "installed ${missing[*]}"
fi
command -v docker >/dev/null || skip "no docker command"

dockerd_pid=""
stop_dockerd() {
  if [ -n "$dockerd_pid" ]; then
    kill "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 40); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
  fi
}
trap stop_dockerd EXIT
if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || skip "no Docker daemon answers, and starting one needs root"
  log=/var/log/cgx-ps-dockerd.log
  dockerd >"$log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 \
    || skip "dockerd did not start: $(grep -m1 -iE 'level=(fatal|error)' "$log" || tail -n 1 "$log")"
  elapsed "dockerd started"
fi

mkdir -p "$cache"
deploy/build-offline.sh "$tag" >"$cache/container-test-build.log" 2>&1 \
  || { tail -n 40 "$cache/container-test-build.log" >&2; exit 1; }
elapsed "image $tag built ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}'))"

# No kernel cache volume: every container starts with an empty NUMBA_CACHE_DIR, as a new pod
# does, and loads the kernels the image compiled while it was built (CGX_PS_KERNEL_CACHE).
CGX_PS_TEST_IMAGE=$tag .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/test_container.py
elapsed "done"
