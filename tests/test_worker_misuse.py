"""The worker API misused the ways users do: each gets an error naming the mistake, or the
behaviour plain PyTorch would have, never silently diverging replicas or a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cgx_ps.server import LocalCluster

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, extra_args=["--round-timeout", "5", "--log-level", "WARNING"]) as c:
        yield c


def run(cluster, scenario: str, servers: list[str] | None = None) -> dict:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               CGX_PS_SERVERS=",".join(servers or cluster.addresses), CGX_PS_JOB_ID=uuid.uuid4().hex[:8],
               OMP_NUM_THREADS="1", CGX_PS_CONNECT_TIMEOUT="10")
    res = subprocess.run([sys.executable, str(ROOT / "tests/workers/misuse_worker.py"), scenario], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario, error", [
    ("unnamed", "ConfigError: the optimizer holds 1 trainable tensor(s) not in named_parameters"),
    ("thawed", "CgxPsError: 1 tensor(s) were frozen (requires_grad=False) when the DistributedOptimizer was created"),
    ("extra_pass", "gradient computed 2 times before step(), but backward_passes_per_step=1"),
    ("nan", "CgxPsError: rank 0: cannot encode the gradient of"),
    ("after_shutdown", "CgxPsError: cgx_ps.worker.shutdown() has closed the connection to the shards"),
])
def test_misuse_is_named(cluster, scenario, error):
    out = run(cluster, scenario)
    assert error in out.get("error", ""), out
    if scenario == "nan":
        assert "NaN/Inf" in out["error"] and ("0.weight" in out["error"] or "2.weight" in out["error"]), out


def test_a_parameter_frozen_after_wrapping_stays_put_as_in_plain_torch(cluster):
    out = run(cluster, "frozen_after")
    assert "error" not in out, out
    assert out["after"] == out["before"]  # weight decay must not touch a frozen tensor


def test_shards_listed_out_of_order_are_named(cluster):
    out = run(cluster, "frozen_after", servers=list(reversed(cluster.addresses)))
    assert "list the shards in index order" in out.get("error", ""), out
    assert "CGX_PS_SERVERS[0]=" in out["error"] and "is shard 1 of 2" in out["error"], out
