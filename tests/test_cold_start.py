"""Shards and workers started with empty kernel caches (a new venv, container or pod).

The shard serves before its kernels exist and compiles the default width's in the background
(kernels/warm.py), any other width on first use; its rounds must still give exactly the bytes of
the reference codec. The workers' updates are checked against test_worker's replay of every
step with the reference encoder, decoder and sum.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_worker import expected_params, run_workers

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("compression", ["4bit", "3bit"])  # the width warmed in the background; one compiled lazily
def test_cold_shards_and_workers_give_the_references_bytes(local_cluster, tmp_path, monkeypatch, compression):
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))  # shards and workers inherit it: nothing compiled yet
    cluster = local_cluster(shards=2)
    if compression == "4bit":
        # the workers load theirs: the 3-bit case compiles the workers' kernels from nothing too,
        # and the 4-bit case is about the shards' rounds waiting on their background compile
        monkeypatch.delenv("NUMBA_CACHE_DIR")
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    results = run_workers(ROOT / "tests/workers/step_worker.py", 2, cluster.addresses,
                          lambda r: ["--compression", compression, "--dtype", "float32", "--steps", "2",
                                     "--accumulate", "1", "--out", str(outs[r])], timeout=120)
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r}:\n{res.stderr[-3000:]}"
    saved = [torch.load(o, weights_only=False) for o in outs]
    for name, value in expected_params(saved[0], 2, 2, 1, torch.float32).items():
        assert torch.equal(saved[0]["final"][name], value), name
        assert torch.equal(saved[1]["final"][name], value), name
    # the kernels were compiled here, from nothing, and cached for the next start
    cached = {p.name for p in cache.rglob("*.nbi")}
    assert any("sum_range" in name for name in cached), cached
    assert compression == "4bit" or any("encode_range" in name for name in cached), cached
