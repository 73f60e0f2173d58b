"""Worker restart and resume (issue 15, items 3 and 4): what DistributedOptimizer.state_dict()
carries, what load_state_dict() refuses, and real restarted jobs that must end bit for bit where
an uninterrupted run ends: under `torchrun --max-restarts 1`, and with the node count changed."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import cgx_ps.worker as cgx
from cgx_ps.server import LocalCluster
from cgx_ps.server.rounds.aggregator import Aggregator
from cgx_ps.server.errors import Conflict, WrongRound
from cgx_ps.v1 import ps_pb2
from cgx_ps.worker import CheckpointError, Checkpoints

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "resume_worker.py"
STEPS, EVERY = 10, 3


CLUSTER_SETTINGS = dict(shards=2, round_timeout=20)  # the tests' shared shards (conftest.cluster)


# ---- the state, in one process --------------------------------------------------------------------

def _model(seed: int = 0, hidden: int = 48) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 30))


def _job(cluster: LocalCluster, model: torch.nn.Module, incarnation: int, compression="adaptive:2", **options):
    cgx.init(servers=cluster.addresses, job_id=f"ckpt-{uuid.uuid4().hex[:6]}" if incarnation == 0 else _job.id,
             incarnation=incarnation)
    _job.id = cgx.init().job_id
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return cgx.DistributedOptimizer(inner, model.named_parameters(), compression=compression, error_feedback=True,
                                    block_bytes=4096, **options)


def _train(model: torch.nn.Module, opt, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 40, generator=g), torch.randn(16, 30, generator=g)
        opt.zero_grad()
        # the second layer's gradient is far larger than the first's: adaptive bits tell them apart
        (torch.nn.functional.mse_loss(model(x), y) + 50 * model[2].weight.square().sum()).backward()
        opt.step()


def _through_a_file(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # plain data and tensors: no pickle of our classes needed


def test_a_resumed_optimizer_continues_bit_for_bit(cluster, monkeypatch):
    """Adaptive bits every 2 steps, error feedback, momentum: 5 steps, a checkpoint, 4 more steps;
    against a new optimizer (a new incarnation, so a new shard session) that loads the checkpoint
    and runs the same 4 steps. The shards resume the blocks at the checkpoint's rounds, so seeds,
    residuals, bit widths and the aggregates are those of the uninterrupted run."""
    monkeypatch.setenv("CGX_PS_SERVERS", ",".join(cluster.addresses))
    model = _model()
    opt = _job(cluster, model, 0)
    _train(model, opt, range(5))
    saved = _through_a_file({"model": model.state_dict(), "optimizer": opt.state_dict()})
    ours = saved["optimizer"]["cgx_ps"]
    assert ours["pipeline"]["steps"] == 5 and set(ours["pipeline"]["rounds"]) == {5}
    assert ours["pipeline"]["residuals"], "error feedback on: compressed blocks have residuals"
    assert len(ours["tuner"]["history"]) == 2  # decisions after steps 1 and 3
    bits = {tuple(s) for s in ours["pipeline"]["settings"] if s[0] == ps_pb2.CODEC_MAXMIN}
    assert {s[1] for s in bits} != {4}, "adaptive bits chose other widths than the layout's 4"
    _train(model, opt, range(5, 9))
    uninterrupted = {n: t.clone() for n, t in model.state_dict().items()}
    final_state = opt.state_dict()["cgx_ps"]
    cgx.shutdown()

    model = _model(seed=1)  # other weights: the checkpoint must bring them back
    model.load_state_dict(saved["model"])
    opt = _job(cluster, model, 1)
    opt.load_state_dict(saved["optimizer"])
    assert {tuple(s) for s in opt.state_dict()["cgx_ps"]["pipeline"]["settings"]
            if s[0] == ps_pb2.CODEC_MAXMIN} == bits
    _train(model, opt, range(5, 9))
    for name, value in model.state_dict().items():
        assert torch.equal(value, uninterrupted[name]), name
    resumed_state = opt.state_dict()["cgx_ps"]
    assert resumed_state["pipeline"]["rounds"] == final_state["pipeline"]["rounds"]
    for block, residual in final_state["pipeline"]["residuals"].items():
        assert torch.equal(resumed_state["pipeline"]["residuals"][block], residual), block
    assert [d["bits"] for d in resumed_state["tuner"]["history"]] == [d["bits"] for d in final_state["tuner"]["history"]]
    cgx.shutdown()


def test_a_checkpoint_that_does_not_fit_is_refused_clearly(cluster, monkeypatch, caplog):
    monkeypatch.setenv("CGX_PS_SERVERS", ",".join(cluster.addresses))
    model = _model()
    opt = _job(cluster, model, 0, compression="4bit")
    _train(model, opt, range(2))
    good = opt.state_dict()
    with pytest.raises(CheckpointError, match="before the first step"):  # rounds already under way
        opt.load_state_dict(good)
    cgx.shutdown()

    other = _model(hidden=64)  # another model: another layout
    opt = _job(cluster, other, 1, compression="4bit")
    with pytest.raises(CheckpointError, match="another model layout"):
        opt.load_state_dict(good)
    damaged = {**good, "cgx_ps": {"pipeline": {k: v for k, v in good["cgx_ps"]["pipeline"].items() if k != "rounds"}}}
    with pytest.raises(CheckpointError, match="lacks rounds"):
        opt.load_state_dict(damaged)
    cgx.shutdown()

    model = _model()
    opt = _job(cluster, model, 2, compression="4bit")
    # another rank's (another node's) file: counters continue, residuals are not ours
    theirs = {**good, "cgx_ps": {**good["cgx_ps"], "pipeline": {**good["cgx_ps"]["pipeline"],
                                                                "owner": {**good["cgx_ps"]["pipeline"]["owner"],
                                                                          "node_rank": 1, "num_nodes": 2}}}}
    opt.load_state_dict(theirs)
    assert "residuals are not this process's" in caplog.text
    state = opt.state_dict()["cgx_ps"]["pipeline"]
    assert state["residuals"] == {} and state["steps"] == 2
    _train(model, opt, range(2, 3))  # the shards resumed the rounds: training goes on
    assert opt.state_dict()["cgx_ps"]["pipeline"]["rounds"][0] == 3
    cgx.shutdown()


def test_a_shard_resumes_blocks_once_and_names_disagreeing_workers():
    block = ps_pb2.BlockSpec(block_id=0, shard=0, numel=64,
                             codec=ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=4, bucket_size=64))
    two_bits = ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=2, bucket_size=64)
    agg = Aggregator([block], 2, None, sink=None, registered=(), round_timeout_s=5)
    agg.resume(40, [(0, two_bits)])
    agg.resume(40, [(0, two_bits)])  # another worker's identical resume: harmless
    assert agg.next_round(0) == 40 and agg.blocks[0].settings_for(40) == two_bits
    with pytest.raises(Conflict, match="same step"):
        agg.resume(41, [(0, two_bits)])
    with pytest.raises(Conflict, match="other codec settings"):
        agg.resume(40, [(0, block.codec)])

    fresh = Aggregator([block], 2, None, sink=None, registered=(), round_timeout_s=5)
    from cgx_ps.kernels import Codec, encode
    payload = encode(torch.randn(64), Codec.MAXMIN, bits=4, bucket_size=64, stochastic=False, seed=0).to_bytes()
    asyncio.run(fresh.push("node-0", 0, 0, 0, payload))
    with pytest.raises(WrongRound, match="before the first step"):
        fresh.resume(40, [(0, two_bits)])


def test_checkpoint_files_resume_from_the_newest_step_every_rank_saved(tmp_path):
    ranks = [Checkpoints(tmp_path, rank=r, world_size=2) for r in range(2)]
    for step in (3, 6):
        for ckpt in ranks:
            ckpt.save(step, {"step": step, "rank": ckpt.rank})
    ranks[0].save(9, {"step": 9, "rank": 0})  # rank 1 was killed before it saved step 9
    assert ranks[1].latest() == (6, 2)
    assert ranks[1].load_latest() == (6, {"step": 6, "rank": 1})
    assert sorted(p.name for p in tmp_path.iterdir() if "rank-0" in p.name) == [
        "step-000000006.rank-0-of-2.pt", "step-000000009.rank-0-of-2.pt"]  # keep=2 per rank
    grown = Checkpoints(tmp_path, rank=2, world_size=3)  # an elastic restart with a third rank
    assert grown.load_latest() == (6, {"step": 6, "rank": 0})
    assert Checkpoints(tmp_path / "none", rank=0, world_size=1).load_latest() == (0, None)


def test_files_without_a_step_every_rank_saved_restart_from_zero_with_a_warning(tmp_path, caplog):
    # under a quorum: node 1 caught up across step 6, and nodes 0 and 2 deleted step 3 on saving 9
    ranks = [Checkpoints(tmp_path, rank=r, world_size=3) for r in range(3)]
    ranks[1].save(3, {})
    for step in (3, 6, 9):
        for r in (0, 2):
            ranks[r].save(step, {})
    with caplog.at_level("WARNING", logger="cgx_ps.worker.checkpoint"):
        assert ranks[1].load_latest() == (0, None)
    assert "holds checkpoint files but no step that every rank saved" in caplog.text
    kept = [Checkpoints(tmp_path / "kept", rank=r, world_size=3, keep=3) for r in range(3)]
    kept[1].save(3, {"step": 3})
    for step in (3, 6, 9):
        for r in (0, 2):
            kept[r].save(step, {"step": step})
    assert kept[1].load_latest() == (3, {"step": 3})  # keep=3, as under a quorum: step 3 is still there


def test_checkpoints_keep_3_by_default_under_a_quorum(tmp_path, monkeypatch):
    from cgx_ps.worker import WorkerConfig, runtime

    assert Checkpoints(tmp_path, rank=0, world_size=3).keep == 2  # before init(): no quorum known
    monkeypatch.setattr(runtime, "_config", WorkerConfig(rank=1, world_size=3, num_nodes=3, servers=("127.0.0.1:1",), quorum=2))
    assert (Checkpoints(tmp_path).keep, Checkpoints(tmp_path).rank) == (3, 1)
    assert Checkpoints(tmp_path, keep=5).keep == 5
    monkeypatch.setattr(runtime, "_config", WorkerConfig(rank=1, world_size=3, num_nodes=3, servers=("127.0.0.1:1",)))
    assert Checkpoints(tmp_path).keep == 2


# ---- real restarted jobs --------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finals(out: Path) -> list[dict]:
    return [torch.load(f, weights_only=True) for f in sorted(out.glob("rank-*.pt"))]


def _job_env(cluster: LocalCluster, job: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CGX_PS_NODE", "CGX_PS_NUM_NODES", "RANK",
                                                                     "WORLD_SIZE", "LOCAL_", "GROUP_", "TORCHELASTIC"))}
    env.update(cluster.worker_env(), CGX_PS_JOB_ID=job, OMP_NUM_THREADS="1", CGX_PS_CONNECT_TIMEOUT="30")
    return env


def _run(launcher: list[str], env: dict[str, str], out: Path, steps: int, *extra: str) -> list[dict]:
    cmd = [*launcher, str(WORKER), "--steps", str(steps), "--every", str(EVERY), "--ckpt", str(out.parent / "ckpt"),
           "--out", str(out), *extra]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    return _finals(out)


def _torchrun(cluster: LocalCluster, tmp_path: Path, die_at: int) -> list[dict]:
    """One job under `torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 1` (two local ranks:
    one node to the shards, reducing through shared memory)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--max-restarts", "1", "--monitor-interval", "0.2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    return _run(torchrun, _job_env(cluster, f"torchrun-{uuid.uuid4().hex[:6]}"), tmp_path / "torchrun" / "out",
                STEPS, "--die-at-step", str(die_at))


def _forked(cluster: LocalCluster, out: Path, nodes: int, local: int, steps: int, job: str) -> list[dict]:
    """The same kind of job, its ranks forked from one process with torchrun's environment (the
    imports paid once: CI time)."""
    return _run([sys.executable], _job_env(cluster, job), out, steps, "--fork-nodes", str(nodes),
                "--fork-local", str(local))


@pytest.mark.slow
def test_a_job_killed_under_torchrun_resumes_to_the_uninterrupted_parameters(cluster, tmp_path):
    # the same job (one node of two local ranks, the same checkpoints) never killed
    reference = _forked(cluster, tmp_path / "reference" / "out", 1, 2, STEPS, f"reference-{uuid.uuid4().hex[:6]}")
    restarted = _torchrun(cluster, tmp_path, die_at=7)  # rank 1 SIGKILLs itself before step 7
    assert [r["incarnation"] for r in restarted] == [1, 1]  # torchrun restarted the job once
    assert [r["resumed_from"] for r in restarted] == [6, 6]  # from the checkpoint after step 6
    assert [r["intranode"] for r in restarted] == ["shm", "shm"]
    for final in [reference[1], *restarted]:
        for name, value in reference[0]["final"].items():
            assert torch.equal(final["final"][name], value), name
    assert restarted[0]["rounds"] == reference[0]["rounds"] == [STEPS] * len(reference[0]["rounds"])


@pytest.mark.slow
def test_a_two_node_job_restarted_as_three_nodes_continues_from_its_checkpoint(cluster, tmp_path):
    """Item 4: the node count changes at a restart (as torchrun --nnodes 2:3 does when a node
    joins: the restart count stays, so no new incarnation). The shards start a new session of 3
    nodes once the 2-node run went away; the third rank starts from rank 0's file."""
    job = f"elastic-{uuid.uuid4().hex[:6]}"
    two = _forked(cluster, tmp_path / "two", 2, 1, 6, job)
    three = _forked(cluster, tmp_path / "three", 3, 1, 9, job)
    assert [r["num_nodes"] for r in three] == [3, 3, 3]
    assert [r["resumed_from"] for r in three] == [6, 6, 6]
    for r in three:  # the rounds continued the checkpoint's numbering
        assert r["rounds"] == [9] * len(two[0]["rounds"])
    for name, value in three[0]["final"].items():  # replicas identical, and trained on from step 6
        assert all(torch.equal(r["final"][name], value) for r in three[1:]), name
        assert not torch.equal(value, two[0]["final"][name]), name
