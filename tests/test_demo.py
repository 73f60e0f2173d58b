"""The README's main job, ``cgx-ps demo``: real shards and workers train the digits model to a
useful accuracy, compressed, with bit-identical replicas; also as nodes of several local ranks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cgx_ps.cli", "demo", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout)


def summary(out: str) -> dict[str, str]:
    lines = out.split("\nsummary\n", 1)[1].splitlines()
    return {m[1]: m[2] for m in (re.match(r"\s+(\S.*?)\s{2,}(.*)", line) for line in lines) if m}


@pytest.mark.parametrize("args, local", [(("--workers", "2", "--shards", "2"), 1),
                                         (("--workers", "4", "--shards", "1", "--local-ranks", "2"), 2)])
def test_demo_trains_compressed_with_identical_replicas(args, local):
    res = run_demo(*args, "--epochs", "4")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    s = summary(res.stdout)
    accuracy = float(s["test accuracy"].split("%")[0])
    assert accuracy > 85.0, s  # digits: ~10% by chance
    assert s["replicas identical"].startswith("yes"), s
    ratio = float(re.search(r"\(([\d.]+)x less\)", s["bytes pushed / node"])[1])
    assert 6.0 < ratio < 8.0, s  # 4-bit with uncompressed biases: ~7.7x fewer bytes than fp32
    assert ("split over its 2 local ranks" in s["bytes pushed / node"]) == (local == 2)
    assert re.search(r"^step \d+/\d+ loss", res.stdout, re.M), res.stdout[:500]  # progress lines


def test_demo_rejects_local_ranks_that_do_not_divide_the_workers():
    res = run_demo("--workers", "4", "--local-ranks", "3", timeout=60)
    assert res.returncode != 0
    assert "--local-ranks 3 must divide --workers 4" in res.stderr
