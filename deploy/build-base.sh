#!/usr/bin/env bash
# Build a local base image for deploy/Dockerfile from Debian's own packages: bookworm (Python
# 3.11, as in python:3.11-slim-bookworm) with python3-venv, made by debootstrap and `docker
# import`. For machines that cannot pull from a registry; with registry access, use the default
# base (python:3.11-slim-bookworm) instead.
#
#   sudo deploy/build-base.sh [TAG]          # default tag: cgx-ps-base:bookworm
#
# Needs root (debootstrap), debootstrap and a reachable Debian mirror (DEBIAN_MIRROR). Does
# nothing when TAG exists; the root filesystem is kept as a tarball under CGX_PS_CACHE
# (default /var/cache/cgx-ps), so a Docker store wiped since is refilled without a download.
set -euo pipefail
tag=${1:-cgx-ps-base:bookworm}
cache=${CGX_PS_CACHE:-/var/cache/cgx-ps}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=bookworm

if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "build-base: $tag already present" >&2
  exit 0
fi
tarball=$cache/rootfs-$suite-python3.tar
if [ ! -s "$tarball" ]; then
  mkdir -p "$cache"
  root=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'rm -rf "$root" "$tarball.part"' EXIT
  echo "build-base: debootstrap $suite from $mirror (a few minutes)..." >&2
  # minbase: dpkg, apt and the Essential set; python3-venv brings python3.11 and ensurepip's
  # wheels, ca-certificates lets pip and apt reach HTTPS indexes from the image.
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$suite" "$root" "$mirror" >"$cache/debootstrap.log" 2>&1 \
    || { tail -n 20 "$cache/debootstrap.log" >&2; exit 1; }
  # What a container never reads: package indexes, downloaded .debs, documentation.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/log/*.log
  tar -C "$root" --numeric-owner -cf "$tarball.part" .
  mv "$tarball.part" "$tarball"
fi
# An imported image has no config: set what the official Python images set, PATH above all
# (deploy/Dockerfile extends $PATH, which would otherwise start out empty).
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$tarball" "$tag" >/dev/null
echo "build-base: imported $tag" >&2
