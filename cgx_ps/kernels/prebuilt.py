"""Kernels compiled ahead of time (the container image's), copied into numba's cache at start.

numba caches a compiled kernel in ``NUMBA_CACHE_DIR``, in an index keyed by the source's hash
and the CPU it was compiled for (LLVM's name for it and its feature flags). A new container or
pod starts with that directory empty, so each process would compile its kernels again (a few
seconds of a core per width, more on a loaded host). The image compiles every width while it is
built (``python -m cgx_ps.kernels.warm`` with ``NUMBA_CACHE_DIR`` set, which also writes
``MANIFEST`` naming the CPU) into a read-only directory that ``CGX_PS_KERNEL_CACHE`` names.

``seed_kernel_cache()`` runs before a process's first kernel: when the prebuilt kernels were
compiled for this CPU, it copies every file the cache lacks into ``NUMBA_CACHE_DIR`` (a file
already there is kept: a volume's cache from an earlier run wins). On another CPU it copies
nothing, and the kernels are compiled as without a prebuilt cache, the safe fallback: numba
would ignore the foreign entries anyway, and copying them would only hide the reason.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

__all__ = ["MANIFEST", "SeedOutcome", "host_cpu", "seed_decision", "seed_kernel_cache", "seed_once",
           "write_manifest"]

MANIFEST = "cgx-ps-kernels.json"
ENV = "CGX_PS_KERNEL_CACHE"

log = logging.getLogger(__name__)

Status = Literal["none", "copied", "other-cpu", "unusable"]


@dataclass(frozen=True)
class SeedOutcome:
    """What ``seed_kernel_cache`` did: ``none`` (no prebuilt cache configured), ``copied``
    (``files`` copied, possibly 0 when the cache already held them all), ``other-cpu`` (built for
    another CPU: nothing copied) or ``unusable`` (missing, unreadable, or nowhere to copy to)."""

    status: Status
    reason: str
    files: int = 0


def host_cpu() -> dict[str, str]:
    """The CPU numba compiles for here, as its cache index keys it (target triple, name, features)."""
    from numba.core.registry import cpu_target

    triple, name, features = cpu_target.target_context.codegen().magic_tuple()
    return {"triple": triple, "cpu": name, "features": features}


def write_manifest(directory: str | os.PathLike[str]) -> Path:
    """Record, next to kernels just compiled into ``directory``, the CPU they were compiled for."""
    path = Path(directory) / MANIFEST
    path.write_text(json.dumps(host_cpu(), indent=1) + "\n")
    return path


def seed_decision(manifest: Optional[dict], host: dict[str, str]) -> SeedOutcome:
    """Whether kernels compiled for ``manifest``'s CPU serve ``host`` (a pure function)."""
    if not isinstance(manifest, dict) or not all(isinstance(manifest.get(k), str) for k in host):
        return SeedOutcome("unusable", f"its {MANIFEST} is missing or malformed")
    if any(manifest[k] != host[k] for k in host):
        same_name = manifest["cpu"] == host["cpu"]
        what = "the same CPU name with other features" if same_name else f"CPU {manifest['cpu']!r}"
        return SeedOutcome("other-cpu", f"compiled for {what}; this host is {host['cpu']!r}")
    return SeedOutcome("copied", "compiled for this CPU")


def seed_kernel_cache(prebuilt: Optional[str] = None, cache_dir: Optional[str] = None) -> SeedOutcome:
    """Copy the prebuilt kernels (``prebuilt``, default ``$CGX_PS_KERNEL_CACHE``) into numba's cache
    (``cache_dir``, default numba's ``NUMBA_CACHE_DIR``) when they were compiled for this CPU.

    Returns:
        A ``SeedOutcome``; never raises: without the prebuilt kernels a process compiles its own.
    """
    prebuilt = prebuilt if prebuilt is not None else os.environ.get(ENV, "")
    if not prebuilt:
        return SeedOutcome("none", f"{ENV} is not set")
    if cache_dir is None:
        from numba.core import config

        cache_dir = config.CACHE_DIR
    if not cache_dir:
        return SeedOutcome("unusable", "NUMBA_CACHE_DIR is not set, so numba's cache has no one directory to copy to")
    source = Path(prebuilt)
    try:
        manifest = json.loads((source / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return SeedOutcome("unusable", f"{source / MANIFEST}: {e}")
    decision = seed_decision(manifest, host_cpu())
    if decision.status != "copied":
        return decision
    try:
        copied = _copy_missing(source, Path(cache_dir))
    except OSError as e:
        return SeedOutcome("unusable", f"copying into {cache_dir}: {e}")
    return SeedOutcome("copied", decision.reason, copied)


def _copy_missing(source: Path, target: Path) -> int:
    """Copy each file under ``source`` that ``target`` lacks. Each lands under a temporary name and
    is linked into place, never over a file: the local ranks of a node seed one cache at once."""
    copied = 0
    for path in source.rglob("*"):
        if not path.is_file() or path.name == MANIFEST:
            continue
        dest = target / path.relative_to(source)
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".cgx-seed-")
        try:
            with os.fdopen(fd, "wb") as out, path.open("rb") as src:
                shutil.copyfileobj(src, out)
            try:
                os.link(tmp, dest)
                copied += 1
            except FileExistsError:  # another process of this node seeded it first
                pass
        finally:
            os.unlink(tmp)
    return copied


_seeded: Optional[SeedOutcome] = None
_seed_lock = threading.Lock()


def seed_once() -> SeedOutcome:
    """``seed_kernel_cache()`` once per process, with one log line when a prebuilt cache is
    configured; later calls return the first call's outcome."""
    global _seeded
    with _seed_lock:
        if _seeded is None:
            _seeded = _log(seed_kernel_cache())
        return _seeded


def _log(outcome: SeedOutcome) -> SeedOutcome:
    if outcome.status == "copied":
        log.debug("prebuilt kernels (%s): %d files copied into numba's cache", outcome.reason, outcome.files)
    elif outcome.status != "none":
        # an operator who built the image for one CPU and runs it on another should know why a
        # start takes seconds longer: the kernels compile as if there were no prebuilt cache
        log.info("prebuilt kernels in %s not used (%s): compiling them", os.environ.get(ENV), outcome.reason)
    return outcome
