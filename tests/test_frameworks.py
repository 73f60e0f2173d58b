"""cgx-ps under the trainers that drive DDP: each example in cgx_ps/examples that registers the
DDP communication hook (plain DDP, Accelerate, Lightning, Hugging Face Trainer) trained by two
real processes (CPU, gloo) against two real shards. Each run must end with bit-identical
replicas, and the shards must have summed every step's gradients, compressed: a framework that
silently dropped the hook would all-reduce through gloo and leave the shards' counters still."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cgx_ps.server import LocalCluster
from cgx_ps.cli.status_table import probe_all
from support import SECURITY, free_port

from test_worker import run_workers  # real worker processes with the job's environment

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

STEPS = 4


# the tests' shared shards (conftest.cluster); a generous round timeout: on a fresh checkout the
# first step of one rank may wait for numba to compile the codec (cached afterwards) while the
# other pushes
CLUSTER_SETTINGS = dict(shards=2, round_timeout=60)


def shard_totals(cluster: LocalCluster) -> list[tuple[int, int]]:
    """(block rounds aggregated, compressed bytes received) per shard, since it started."""
    reports = probe_all(cluster.addresses, SECURITY)
    assert all(r.status is not None for r in reports), [r.problems or r.health_detail for r in reports]
    return [(r.status.rounds_total, r.status.bytes_in) for r in reports]


# (example module, the package it needs, its arguments): the small synthetic task of each
EXAMPLES = [
    ("ddp_train", None, ["--data", "synthetic", "--hidden", "128"]),
    ("accelerate_train", "accelerate", ["--data", "synthetic", "--hidden", "128"]),
    ("lightning_train", "pytorch_lightning", ["--data", "synthetic", "--hidden", "128"]),
    ("hf_trainer_train", "transformers", ["--hidden", "64"]),
]


@pytest.mark.parametrize("example, package, args", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_example_trains_through_the_shards_with_identical_replicas(cluster, example, package, args):
    if package and importlib.util.find_spec(package) is None:  # not importorskip: importing Lightning costs ~10 s
        pytest.skip(f"{package} is not installed (pip install -e .[dev])")
    before = shard_totals(cluster)
    # what torchrun would set: DDP's own rendezvous, and TORCHELASTIC_RUN_ID, by which Lightning
    # knows the processes exist already (without it, it would launch its own)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_RUN_ID": "test",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = run_workers(ROOT / f"cgx_ps/examples/{example}.py", 2, cluster.addresses,
                          lambda r: [*args, "--compression", "4bit", "--max-steps", str(STEPS), "--json"],
                          env_extra=env)
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r}:\n{res.stderr[-3000:]}"
    done = [next(json.loads(line) for line in res.stdout.splitlines() if line.startswith('{"event": "done"'))
            for res in results]
    assert [d["steps"] for d in done] == [STEPS, STEPS]
    assert done[0]["param_sha256"] == done[1]["param_sha256"]  # replicas bit-identical
    assert [d["hook_steps"] for d in done] == [STEPS, STEPS]  # the cgx-ps hook ended every step

    after = shard_totals(cluster)
    rounds = [a[0] - b[0] for a, b in zip(after, before)]
    assert sum(rounds) == STEPS * done[0]["blocks"], rounds  # the shards summed every block of every step
    pushed = sum(a[1] - b[1] for a, b in zip(after, before))
    fp32 = 2 * STEPS * 4 * done[0]["parameters"]  # what two nodes would push uncompressed
    assert 0 < pushed < fp32 / 4, (pushed, fp32)  # 4-bit: ~7x fewer bytes (small tensors go uncompressed)


def _done(results) -> list[dict]:
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r}:\n{res.stderr[-3000:]}"
    return [next(json.loads(line) for line in res.stdout.splitlines() if line.startswith('{"event": "done"'))
            for res in results]


def test_ddp_train_resumes_from_its_checkpoint_to_the_uninterrupted_parameters(cluster, tmp_path):
    """--checkpoint was once accepted and ignored: a restarted job began again
    from step 0. Now a job stopped after step 5 resumes from its step-4 checkpoint (model,
    optimizer, the hook's counters and error-feedback residuals) and ends where one never stopped."""
    env = {"MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RUN_ID": "test"}
    args = ["--data", "synthetic", "--hidden", "128", "--compression", "4bit", "--error-feedback", "--json"]

    def job(steps: int, *extra: str) -> list[dict]:
        return _done(run_workers(ROOT / "cgx_ps/examples/ddp_train.py", 2, cluster.addresses,
                                 lambda r: [*args, "--max-steps", str(steps), *extra],
                                 env_extra={**env, "MASTER_PORT": str(free_port())}))

    reference = job(7)
    checkpointed = ["--checkpoint", str(tmp_path), "--checkpoint-every", "2"]
    stopped = job(5, *checkpointed)
    assert sorted(p.name for p in tmp_path.glob("*.pt"))[-2:] == ["step-000000004.rank-0-of-2.pt",
                                                                 "step-000000004.rank-1-of-2.pt"]
    resumed = job(7, *checkpointed)
    assert [d["resumed_from"] for d in resumed] == [4, 4]
    assert [d["hook_steps"] for d in resumed] == [7, 7]  # the hook's step counter came back too
    assert stopped[0]["param_sha256"] != reference[0]["param_sha256"]
    assert {d["param_sha256"] for d in resumed} == {reference[0]["param_sha256"]}


@pytest.mark.parametrize("example", ["accelerate_train", "lightning_train"])
def test_examples_that_save_no_checkpoint_refuse_the_flag(example, tmp_path):
    """They shared train.py's parser, so --checkpoint was accepted and silently ignored."""
    run = subprocess.run([sys.executable, str(ROOT / f"cgx_ps/examples/{example}.py"), "--checkpoint", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "unrecognized arguments: --checkpoint" in run.stderr
