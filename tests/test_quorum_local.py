"""Quorum rounds on nodes of several local ranks: the node's ranks decide together whether it
was late (a vote through their segments), catch up on the same rounds from their owners'
fetches, and end bit-identical to every rank of every other node."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Callable
from pathlib import Path

import pytest
import torch

from cgx_ps.worker import WorkerConfig
from cgx_ps.worker.intranode.reduction import NodeReducer
from cgx_ps.worker.pipeline.catch_up import node_closed, node_late_at
from support import env_for, free_port, wait_until_stopped
from workers import reduce_worker
from workers.warm_start import start_worker

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests/workers/quorum_worker.py"
NODES, LOCAL = 3, 2


def start_ranks(cluster, args_for, tmp_path: Path, nodes: int = NODES, **env: str) -> list[subprocess.Popen]:
    """``nodes`` nodes of LOCAL ranks each (global rank = node * LOCAL + local rank), as torchrun numbers them."""
    job = {"CGX_PS_JOB_ID": f"qlocal-{uuid.uuid4().hex[:8]}", **env}
    procs = []
    for rank in range(nodes * LOCAL):
        node, local = divmod(rank, LOCAL)
        rank_env = env_for(rank, nodes * LOCAL, cluster.addresses, LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(LOCAL),
                           CGX_PS_NODE_RANK=str(node), CGX_PS_NUM_NODES=str(nodes), **job)
        procs.append(start_worker([sys.executable, str(WORKER), "--out", str(tmp_path / f"r{rank}.pt"),
                                   *args_for(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=rank_env))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[dict]:
    try:
        outs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exit {proc.returncode}:\n{outs[rank][1][-4000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def stop_then_continue(procs: list[subprocess.Popen], stopped: int, seconds: float,
                       until: Callable[[], bool] | None = None) -> None:
    """Wait until ``procs[stopped]`` has SIGSTOPped itself (the worker's --sigstop-at), leave it
    stopped ``seconds`` (or, with ``until``, until that holds, ``seconds`` at most), SIGCONT it;
    if that fails, every process is killed."""
    try:
        wait_until_stopped(procs[stopped].pid, timeout=120)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until is not None and until()):
            time.sleep(0.01)
        procs[stopped].send_signal(signal.SIGCONT)
    except BaseException:
        for proc in procs:
            proc.kill()
        raise


def steps_done(progress: Path) -> int:
    """The steps a quorum worker run with --progress wrote it had finished (0 before its first)."""
    try:
        return int(progress.read_text() or 0)
    except (FileNotFoundError, ValueError):  # not written yet, or caught mid-write
        return 0


def test_quorum_rounds_are_accepted_with_several_local_ranks_per_node():
    env = {"CGX_PS_SERVERS": "127.0.0.1:7070", "CGX_PS_NUM_NODES": "3", "CGX_PS_NODE_RANK": "1", "RANK": "3",
           "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    config = WorkerConfig.from_env({**env, "CGX_PS_QUORUM": "2", "CGX_PS_GRACE_MS": "20"})
    assert config.has_quorum and config.local_world_size == 2


def test_the_node_is_late_if_any_rank_heard_so_and_takes_the_round_under_way_only_if_every_rank_got_it():
    assert node_late_at([-1, -1, -1]) is None  # every block in time
    assert node_late_at([-1, 12, 9]) == 12  # the furthest any block had moved on
    assert node_late_at([]) is None
    assert node_closed([1, 1]) and not node_closed([1, 0]) and not node_closed([0, 0])


def test_local_ranks_vote_alike_through_their_segments_vote_after_vote():
    """Two local ranks (threads here, each with its own segment) take 40 votes back to back: each
    gets every rank's value of each vote, in rank order, though a rank may run a vote ahead."""
    job, tag = f"vote-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    got: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            reducer = NodeReducer(reduce_worker.layout(), r, 2, 0, job, timeout_s=20, run_tag=tag)
            got[r] = [reducer.vote(100 * r + i, "a test vote") for i in range(40)]
            reducer.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got[0] == got[1] == [[i, 100 + i] for i in range(40)]


@pytest.mark.slow
def test_without_a_stall_quorum_rounds_on_local_ranks_match_a_run_without_quorum(local_cluster, tmp_path):
    # two nodes: a shard's sum of two pushes is the same in either arrival order, so two runs'
    # sums are bit-identical (with three, the order of a round's pushes shows in its last bits)
    cluster = local_cluster(2, round_timeout=30)
    args = lambda rank: ["--steps", "6", "--step-s", "0"]  # noqa: E731
    plain = finish(start_ranks(cluster, args, tmp_path, nodes=2))
    with_quorum = finish(start_ranks(cluster, args, tmp_path, nodes=2, CGX_PS_QUORUM="1", CGX_PS_GRACE_MS="5000"))
    assert len({r["digest"] for r in plain + with_quorum}) == 1, [(r["rank"], r["digest"][:8]) for r in plain + with_quorum]
    assert [r["steps"] for r in plain + with_quorum] == [6] * 8
    assert all(r["computed"] == 6 for r in with_quorum)  # nobody late: every step computed


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["optimizer", "ddp hook"])
def test_a_node_with_a_sigstopped_rank_is_passed_and_its_ranks_catch_up_together(local_cluster, tmp_path, front_end):
    # local rank 1 of node 2 stops itself: its node's other rank waits for its gradient, so the
    # node pushes nothing, and the other nodes' rounds close without it
    cluster = local_cluster(2, round_timeout=30)
    steps, stopped = 30, NODES * LOCAL - 1
    ddp = ["--ddp"] if front_end == "ddp hook" else []
    gloo = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())) if ddp else {}
    procs = start_ranks(cluster, lambda rank: ["--steps", str(steps), *ddp]
                        + (["--sigstop-at", "5"] if rank == stopped else []),
                        tmp_path, CGX_PS_QUORUM="2", CGX_PS_GRACE_MS="20", **gloo)
    stop_then_continue(procs, stopped, 0.5)  # ~10 of the others' 50 ms rounds: fewer than the 16 a shard keeps
    results = finish(procs)
    assert [r["steps"] for r in results] == [steps] * 6
    assert len({r["digest"] for r in results}) == 1, results  # replicas bit-identical on every rank
    node_2 = results[4:]
    assert node_2[0]["computed"] == node_2[1]["computed"]  # the node's ranks caught up on the same rounds
    # the others went on while it was stopped, and it applied the rounds it missed without computing them
    assert node_2[0]["computed"] < steps - 3 and node_2[0]["computed"] < min(r["computed"] for r in results[:4])
    params = [torch.load(tmp_path / f"r{rank}.pt") for rank in range(6)]
    assert any(k.startswith("momentum/") for k in params[0])  # the optimizer's state is compared too
    assert all(torch.equal(params[0][k], p[k]) for p in params[1:] for k in params[0])


@pytest.mark.slow
def test_a_node_whose_ranks_catch_up_applies_the_adaptive_bits_decided_meanwhile_on_every_local_rank(local_cluster,
                                                                                                    tmp_path):
    # as above, with adaptive bits every 2 steps (the worker's data makes them change every 4):
    # each of node 2's ranks reads the decisions of the rounds it catches up on, rank 0 included
    # among the ranks of another node, so every rank ends with the same decisions and settings
    cluster = local_cluster(2, round_timeout=30)
    steps, stopped = 24, NODES * LOCAL - 1
    progress = [tmp_path / f"progress{r}" for r in range(NODES * LOCAL)]
    procs = start_ranks(cluster, lambda rank: ["--steps", str(steps), "--compression", "adaptive:2",
                                               "--progress", str(progress[rank])]
                        + (["--sigstop-at", "7"] if rank == stopped else []),
                        tmp_path, CGX_PS_QUORUM="2", CGX_PS_GRACE_MS="20")
    # stopped until the other nodes have finished 10 rounds without node 2, on a loaded machine too
    stop_then_continue(procs, stopped, 60.0, until=lambda: steps_done(progress[0]) >= steps_done(progress[stopped]) + 10)
    results = finish(procs)
    assert [r["steps"] for r in results] == [steps] * 6
    for key in ("digest", "decisions", "bits", "checkpoint"):
        assert len({json.dumps(r[key]) for r in results}) == 1, (key, [r[key] for r in results])
    node_2 = results[4:]
    assert node_2[0]["caught_up"] == node_2[1]["caught_up"]
    assert sum(1 for s in node_2[0]["caught_up"] if s % 2 == 1) >= 2, node_2[0]["caught_up"]  # decision steps
