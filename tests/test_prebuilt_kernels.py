"""Kernels compiled ahead of time (the container image's CGX_PS_KERNEL_CACHE) and copied into an
empty NUMBA_CACHE_DIR at start: a process then loads every kernel and compiles none; a cache
compiled for another CPU, a broken manifest or an unwritable target is refused with a reason and
the process compiles its kernels as before.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cgx_ps.kernels.prebuilt import MANIFEST, SeedOutcome, host_cpu, seed_decision, seed_kernel_cache, write_manifest

ROOT = Path(__file__).resolve().parents[1]
HOST = {"triple": "x86_64-unknown-linux-gnu", "cpu": "znver4", "features": "+avx2,+avx512f"}

# A process that seeds its cache, warms 2-bit kernels for both roles and prints how many of its
# kernels numba loaded from the cache and how many it compiled.
PROBE = """
import json
from cgx_ps.kernels import cpu_loops, warm
from cgx_ps.kernels.prebuilt import seed_once
outcome = seed_once()
warm.warm_width(2, "both")
kernels = list(cpu_loops._built.values()) + [cpu_loops.first_bad_meta_kernel]
hits = sum(sum(k.stats.cache_hits.values()) for k in kernels)
misses = sum(sum(k.stats.cache_misses.values()) for k in kernels)
print(json.dumps({"status": outcome.status, "files": outcome.files, "hits": hits, "misses": misses}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "CGX_PS_KERNEL_CACHE")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env=_env(**env), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _prebuilt_from_the_in_tree_cache(prebuilt: Path) -> None:
    """A prebuilt directory as the image makes one, without compiling here: the 2-bit kernels are
    loaded into the in-tree cache (scripts/test.sh compiled them there), their files copied where
    NUMBA_CACHE_DIR=prebuilt keeps them, and ``python -m cgx_ps.kernels.warm`` run on it, which
    loads them from there and writes the manifest."""
    from numba.core.caching import UserProvidedCacheLocator

    from cgx_ps.kernels import cpu_loops

    warm = [sys.executable, "-m", "cgx_ps.kernels.warm", "--widths", "2"]
    in_tree = subprocess.run(warm, env=_env(), capture_output=True, text=True, timeout=300)
    assert in_tree.returncode == 0, in_tree.stderr[-3000:]
    source = Path(cpu_loops.__file__).parent
    target = prebuilt / UserProvidedCacheLocator.get_suitable_cache_subpath(cpu_loops.__file__)
    target.mkdir(parents=True)
    for path in (source / "__pycache__").glob("*.nb[ic]"):
        shutil.copy(path, target / path.name)
    built = subprocess.run(warm, env=_env(NUMBA_CACHE_DIR=str(prebuilt)), capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert MANIFEST in built.stdout and json.loads((prebuilt / MANIFEST).read_text()) == host_cpu()


def test_kernels_prebuilt_for_this_cpu_are_loaded_into_an_empty_cache_and_none_is_compiled(tmp_path):
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    _prebuilt_from_the_in_tree_cache(prebuilt)
    first = _probe(NUMBA_CACHE_DIR=str(cache), CGX_PS_KERNEL_CACHE=str(prebuilt))
    assert first["status"] == "copied" and first["files"] > 0, first
    assert first["misses"] == 0 and first["hits"] >= 4, first  # encode, decode, sum and the checks: all loaded


def test_kernels_prebuilt_for_another_cpu_are_not_copied(tmp_path):
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    (prebuilt / "kernels_x").mkdir(parents=True)
    (prebuilt / "kernels_x" / "cpu_loops.encode_range-235.py311.nbi").write_bytes(b"index")
    (prebuilt / MANIFEST).write_text(json.dumps({**host_cpu(), "cpu": "some-other-cpu"}))
    outcome = seed_kernel_cache(str(prebuilt), str(cache))
    assert outcome.status == "other-cpu" and "some-other-cpu" in outcome.reason and outcome.files == 0
    assert not cache.exists() or not any(cache.rglob("*"))


def test_existing_cache_files_are_kept_and_only_missing_ones_copied(tmp_path):
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    for name in ("a.nbi", "a.nbc", "b.nbi"):
        (prebuilt / "kernels_x").mkdir(parents=True, exist_ok=True)
        (prebuilt / "kernels_x" / name).write_bytes(b"prebuilt " + name.encode())
    write_manifest(prebuilt)
    (cache / "kernels_x").mkdir(parents=True)
    (cache / "kernels_x" / "a.nbi").write_bytes(b"the volume's own")

    outcome = seed_kernel_cache(str(prebuilt), str(cache))
    assert outcome == SeedOutcome("copied", "compiled for this CPU", 2)
    assert (cache / "kernels_x" / "a.nbi").read_bytes() == b"the volume's own"
    assert (cache / "kernels_x" / "b.nbi").read_bytes() == b"prebuilt b.nbi"
    assert not (cache / MANIFEST).exists()
    assert sorted(p.name for p in (cache / "kernels_x").iterdir()) == ["a.nbc", "a.nbi", "b.nbi"]  # no temporaries
    assert seed_kernel_cache(str(prebuilt), str(cache)).files == 0


@pytest.mark.parametrize("manifest", [None, "not json", json.dumps(["a list"]), json.dumps({"cpu": 3})])
def test_a_missing_or_malformed_manifest_is_unusable_never_an_error(tmp_path, manifest):
    (tmp_path / "prebuilt").mkdir()
    if manifest is not None:
        (tmp_path / "prebuilt" / MANIFEST).write_text(manifest)
    outcome = seed_kernel_cache(str(tmp_path / "prebuilt"), str(tmp_path / "cache"))
    assert outcome.status == "unusable" and MANIFEST in outcome.reason and outcome.files == 0


def test_a_cache_directory_that_cannot_be_written_is_unusable_never_an_error(tmp_path):
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    (prebuilt / "kernels_x").mkdir(parents=True)
    (prebuilt / "kernels_x" / "a.nbi").write_bytes(b"x")
    write_manifest(prebuilt)
    cache.write_text("a file where the directory should be")  # (root writes into any directory)
    outcome = seed_kernel_cache(str(prebuilt), str(cache))
    assert outcome.status == "unusable" and str(cache) in outcome.reason


def test_nothing_configured_or_no_cache_directory():
    assert seed_kernel_cache("", "/tmp").status == "none"
    assert seed_kernel_cache("/nonexistent", "").status == "unusable"


def test_seed_decision():
    assert seed_decision(dict(HOST), HOST).status == "copied"
    other = seed_decision({**HOST, "cpu": "skylake-avx512"}, HOST)
    assert other.status == "other-cpu" and "'skylake-avx512'" in other.reason and "'znver4'" in other.reason
    features = seed_decision({**HOST, "features": "+avx2"}, HOST)
    assert features.status == "other-cpu" and "other features" in features.reason
    assert seed_decision(None, HOST).status == "unusable"
    assert seed_decision({"cpu": "znver4"}, HOST).status == "unusable"
