"""Quorum rounds (CGX_PS_QUORUM, CGX_PS_GRACE_MS): rounds that close without the slowest node,
replicas still bit-identical; a late node's gradient carried, its missed rounds caught up on;
settings checked on both ends."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from cgx_ps.quorum_settings import quorum_problem
from cgx_ps.server.rounds.quorum import LateWatch, QuorumRule, RoundHistory
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker import ConfigError, WorkerConfig
from support import METADATA, env_for, free_port, wait_until_stopped
from workers.warm_start import start_worker

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests/workers/quorum_worker.py"

CLUSTER_SETTINGS = dict(shards=2, round_timeout=30)  # the refusal test's shards (conftest.cluster)


def start_nodes(cluster, nodes: int, args_for, tmp_path: Path, **env: str) -> list[subprocess.Popen]:
    job = {"CGX_PS_JOB_ID": f"quorum-{uuid.uuid4().hex[:8]}", **env}
    return [start_worker([sys.executable, str(WORKER), "--out", str(tmp_path / f"n{r}.pt"), *args_for(r)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env_for(r, nodes, cluster.addresses, **job))
            for r in range(nodes)]


def run_nodes(cluster, nodes: int, args_for, tmp_path: Path, timeout: float = 240, **env: str) -> list[dict]:
    results = []
    for r, proc in enumerate(start_nodes(cluster, nodes, args_for, tmp_path, **env)):
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"node {r} exit {proc.returncode}:\n{err[-4000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def node_2_stalls(steps: int, at: int, seconds: float):
    """run_nodes' args_for: every node trains ``steps`` steps, node 2 stalls ``seconds`` before its step ``at``."""
    return lambda r: ["--steps", str(steps)] + (["--stall-at", str(at), "--stall-s", str(seconds)] if r == 2 else [])


def shard_status(address: str) -> ps_pb2.StatusResponse:
    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.ParameterServerStub(channel).Status(ps_pb2.StatusRequest(), metadata=METADATA, timeout=10)


@pytest.mark.slow
def test_a_stalled_node_does_not_hold_the_others_and_catches_up_to_identical_parameters(local_cluster, tmp_path):
    # shards of its own: the last rounds the late node pushed alone stay open until their timeout
    cluster = local_cluster(2, round_timeout=30)
    steps = 24
    results = run_nodes(cluster, 3, node_2_stalls(steps, 4, 0.8), tmp_path, CGX_PS_QUORUM="2", CGX_PS_GRACE_MS="20")
    assert [r["steps"] for r in results] == [steps] * 3
    assert len({r["digest"] for r in results}) == 1, results  # replicas bit-identical
    # the stalled node fell behind by the rounds the others closed without it (0.8 s of 50 ms
    # steps), and applied them without computing them (a node late by a grace of 20 ms now and
    # then catches up on a round too, hence no exact count for the others)
    assert results[2]["computed"] < steps - 2 and results[2]["computed"] < min(r["computed"] for r in results[:2])
    params = [torch.load(tmp_path / f"n{r}.pt") for r in range(3)]
    assert all(torch.equal(params[0][k], p[k]) for p in params[1:] for k in params[0])
    # the shards saw it: the quorum and the late node in Status (cgx-ps status), in the metrics
    for address in cluster.addresses:
        status = shard_status(address)
        assert (status.quorum, status.grace_ms, status.num_nodes) == (2, 20, 3)
        late = dict(zip(status.late_nodes, status.late_pushes))
        assert late.get("node-2", 0) >= 1, late


@pytest.mark.slow
def test_checkpoints_saved_after_a_catch_up_resume_every_node_to_identical_parameters(local_cluster, tmp_path):
    # node 2 stalls and catches up, then every node saves its state_dict(); the job restarted (as
    # torchrun restarts it: the same job) loads each node's own file, and the shards resume the
    # blocks at the checkpoint's rounds, which the caught-up node's counters must match
    cluster = local_cluster(2, round_timeout=30)
    settings = dict(CGX_PS_QUORUM="2", CGX_PS_GRACE_MS="20", CGX_PS_JOB_ID=f"quorum-{uuid.uuid4().hex[:8]}")
    ckpt = [tmp_path / f"ckpt{r}.pt" for r in range(3)]
    first = run_nodes(cluster, 3, lambda r: node_2_stalls(16, 4, 0.8)(r) + ["--save", str(ckpt[r])], tmp_path,
                      **settings)
    assert first[2]["caught_up"] and len({r["digest"] for r in first}) == 1, first
    assert len({json.dumps(r["checkpoint"]) for r in first}) == 1, [r["checkpoint"] for r in first]
    resumed = run_nodes(cluster, 3, lambda r: ["--steps", "22", "--resume", str(ckpt[r])], tmp_path, **settings)
    assert [r["steps"] for r in resumed] == [22] * 3
    assert all(r["computed"] + len(r["caught_up"]) == 6 for r in resumed), resumed  # counted on from step 16
    assert len({r["digest"] for r in resumed}) == 1 and resumed[0]["digest"] != first[0]["digest"], resumed
    assert resumed[0]["checkpoint"]["rounds"] == [22] * len(first[0]["checkpoint"]["rounds"])


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["optimizer", "ddp hook"])
def test_a_sigstopped_node_is_passed_by_the_others_and_after_sigcont_catches_up_to_identical_parameters(
        local_cluster, tmp_path, front_end):
    # with a learning rate that falls every step (a per-step scheduler given to cgx.catch_up_with):
    # a round caught up on at another step's rate would part the replicas in their last bits
    cluster = local_cluster(2, round_timeout=30)
    steps = 40
    ddp = ["--ddp"] if front_end == "ddp hook" else []
    gloo = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())) if ddp else {}
    procs = start_nodes(cluster, 3, lambda r: ["--steps", str(steps), "--scheduler", *ddp]
                        + (["--sigstop-at", "5"] if r == 2 else []),
                        tmp_path, CGX_PS_QUORUM="2", CGX_PS_GRACE_MS="20", **gloo)
    try:
        wait_until_stopped(procs[2].pid, timeout=120)
        # frozen whole (its gRPC threads too) for ~10 of the others' 50 ms rounds: fewer than the 16
        # results a shard keeps for late nodes, so it can catch up on every round it missed
        time.sleep(0.5)
        procs[2].send_signal(signal.SIGCONT)
        outs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"node {r}:\n{outs[r][1][-4000:]}"
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [r["steps"] for r in results] == [steps] * 3
    assert len({r["digest"] for r in results}) == 1, results  # replicas bit-identical
    assert [r["lr"] for r in results] == [pytest.approx(0.05 / (1 + 0.1 * steps))] * 3  # every schedule at its end
    # the others went on while it was stopped (waiting for it, it would have computed every step),
    # and it applied the rounds it missed without computing them
    assert results[2]["computed"] < steps - 3 and results[2]["computed"] < min(r["computed"] for r in results[:2])
    params = [torch.load(tmp_path / f"n{r}.pt") for r in range(3)]
    assert any(k.startswith("momentum/") for k in params[0])  # the optimizer's state is compared too
    assert all(torch.equal(params[0][k], p[k]) for p in params[1:] for k in params[0])


def test_the_ddp_hook_refuses_a_quorum_without_an_optimizer_to_catch_up_with(cluster, tmp_path):
    script = (
        "import torch, torch.distributed as dist, cgx_ps.worker as cgx\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "cgx.init(); dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "ddp = DDP(torch.nn.Linear(8, 2)); state = cgx.DDPHookState(ddp)\n"
        "ddp.register_comm_hook(state, cgx.ddp_comm_hook)\n"
        "try:\n    ddp(torch.randn(4, 8)).sum().backward()\n"
        "except Exception as exc:\n    print('refused:', type(exc).__name__, exc)\n")
    env = env_for(0, 2, cluster.addresses, CGX_PS_JOB_ID=f"quorum-{uuid.uuid4().hex[:8]}", CGX_PS_QUORUM="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: ConfigError CGX_PS_QUORUM=1 under the DDP hook: call cgx.catch_up_with(optimizer, hook_state=state)" \
        in done.stdout, done.stdout + done.stderr[-2000:]


@pytest.mark.slow
def test_a_node_late_once_by_more_than_the_grace_is_not_late_from_then_on(local_cluster, tmp_path):
    # node 2 is held up once by a little less than a step, more than the grace: its push of that
    # round is late, and it would start every later compute that much after the others (late
    # on every round, each costing the grace) had it not skipped the round under way to resync
    # steps of 100 ms and a 90 ms stall: 75 ms past the grace, which the others' own scheduling delays
    # on a loaded machine do not make up (with 50 ms and 45 ms the node was once in time)
    cluster = local_cluster(2, round_timeout=30)
    steps = 40
    results = run_nodes(cluster, 3, lambda r: node_2_stalls(steps, 5, 0.09)(r) + ["--step-s", "0.1"], tmp_path,
                        CGX_PS_QUORUM="2", CGX_PS_GRACE_MS="15")
    assert len({r["digest"] for r in results}) == 1, results
    for address in cluster.addresses:
        status = shard_status(address)
        late = dict(zip(status.late_nodes, status.late_pushes))
        # once, and now and then by scheduling jitter (more of it on a loaded machine): not on most
        # of the 35 rounds after it, as it would be without its resync
        assert 1 <= late.get("node-2", 0) <= 17, late


@pytest.mark.slow
def test_without_a_stall_quorum_rounds_take_every_node_and_match_a_run_without_quorum(local_cluster, tmp_path):
    cluster = local_cluster(2, round_timeout=30)
    plain = run_nodes(cluster, 2, lambda r: ["--steps", "6", "--step-s", "0"], tmp_path)
    with_quorum = run_nodes(cluster, 2, lambda r: ["--steps", "6", "--step-s", "0"], tmp_path,
                            CGX_PS_QUORUM="1", CGX_PS_GRACE_MS="5000")  # a grace no step needs
    assert plain[0]["digest"] == plain[1]["digest"] == with_quorum[0]["digest"] == with_quorum[1]["digest"]


@pytest.mark.slow
def test_a_node_killed_mid_run_is_named_once_and_the_others_go_on_to_identical_parameters(local_cluster, tmp_path):
    cluster = local_cluster(2, round_timeout=30, log_dir=str(tmp_path))
    steps = 20
    procs = start_nodes(cluster, 3, lambda r: ["--steps", str(steps)] + (["--die-at", "5"] if r == 2 else []),
                        tmp_path, CGX_PS_QUORUM="2", CGX_PS_GRACE_MS="20")
    outs = [proc.communicate(timeout=120) for proc in procs]
    assert procs[2].returncode == -signal.SIGKILL, outs[2][1][-2000:]
    for r in (0, 1):
        assert procs[r].returncode == 0, f"node {r}:\n{outs[r][1][-4000:]}"
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs[:2]]
    assert [r["steps"] for r in results] == [steps] * 2
    assert results[0]["digest"] == results[1]["digest"], results  # the survivors stay bit-identical
    # no round waited for the round timeout (30 s): 20 steps of 50 ms, and the grace of a few
    assert all(r["train_s"] < 10 for r in results), results
    # each shard names the dead node once, not once per round it missed
    for i in range(2):
        lines = [line for line in (tmp_path / f"shard{i}.log").read_text().splitlines() if "node-2" in line]
        named = [line for line in lines if "went away" in line]
        assert len(named) == 1 and "2 of 3 nodes remain" in named[0] and "CGX_PS_QUORUM=2" in named[0], lines


@pytest.mark.slow
def test_with_fewer_than_the_quorum_left_the_last_node_fails_at_the_round_timeout_naming_the_dead(local_cluster,
                                                                                                   tmp_path):
    # K=2 of 3: node 2 is killed at its step 3 (two remain: the rounds go on), node 1 at its step 8
    # (one remains: the next round waits for a second node, and fails at the round timeout)
    cluster = local_cluster(2, round_timeout=4, log_dir=str(tmp_path))
    started = time.monotonic()
    die = {1: "8", 2: "3"}
    procs = start_nodes(cluster, 3, lambda r: ["--steps", "40"] + (["--die-at", die[r]] if r in die else []),
                        tmp_path, CGX_PS_QUORUM="2", CGX_PS_GRACE_MS="20")
    outs = [proc.communicate(timeout=120) for proc in procs]
    assert procs[1].returncode == procs[2].returncode == -signal.SIGKILL
    assert procs[0].returncode != 0, outs[0]  # the existing failure, no hang
    assert "timed out after 4s waiting for node(s): node-1, node-2" in outs[0][1], outs[0][1][-3000:]
    assert time.monotonic() - started < 60  # process starts under load; the failure came at the timeout
    logs = [(tmp_path / f"shard{i}.log").read_text().splitlines() for i in range(2)]
    for lines in logs:  # node 2, once, as the rounds went on without it
        named = [line for line in lines if "went away" in line]
        assert len(named) == 1 and "node node-2" in named[0] and "2 of 3 nodes remain" in named[0], lines
    # node 1 by the round that failed first (node 0 is gone before the other shard's times out too)
    assert any("round failed" in line and "node-1, node-2" in line for lines in logs for line in lines), logs


def test_nodes_that_disagree_on_the_quorum_are_refused_naming_both_values(cluster):
    layout = ps_pb2.Layout(num_shards=2)
    channel = grpc.insecure_channel(cluster.addresses[0])
    try:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        job = f"disagree-{uuid.uuid4().hex[:8]}"
        from cgx_ps.model_layout import layout_hash

        def register(node: str, quorum: int, grace: int):
            return stub.Register(ps_pb2.RegisterRequest(node_id=node, num_nodes=3, layout=layout,
                                                        layout_hash=layout_hash(layout), job_id=job, quorum=quorum,
                                                        grace_ms=grace), metadata=METADATA, timeout=10)
        register("node-0", 2, 50)
        with pytest.raises(grpc.RpcError) as refused:
            register("node-1", 3, 50)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION or "CGX_PS_QUORUM" in refused.value.details()
        assert "CGX_PS_QUORUM=3" in refused.value.details() and "CGX_PS_QUORUM=2" in refused.value.details()
        with pytest.raises(grpc.RpcError) as bad:
            register("node-2", 4, 50)
        assert "CGX_PS_QUORUM=4" in bad.value.details()
    finally:
        channel.close()


@pytest.mark.parametrize("quorum, grace, nodes, problem", [
    (0, 50, 4, None), (3, 0, 4, None), (4, 60_000, 4, None),
    (5, 50, 4, "CGX_PS_QUORUM=5: must be a number of nodes in 1..4"),
    (-1, 50, 4, "CGX_PS_QUORUM=-1"),
    (2, 60_001, 4, "CGX_PS_GRACE_MS=60001: must be in 0..60000"),
    (2, -5, 4, "CGX_PS_GRACE_MS=-5"),
])
def test_quorum_settings_are_checked(quorum, grace, nodes, problem):
    found = quorum_problem(quorum, grace, nodes)
    assert (found is None) if problem is None else (problem in found), found


def test_bad_quorum_settings_fail_at_init_naming_the_variable():
    env = {"CGX_PS_SERVERS": "127.0.0.1:7070", "CGX_PS_NUM_NODES": "4", "CGX_PS_NODE_RANK": "0"}
    with pytest.raises(ConfigError, match="CGX_PS_QUORUM=9"):
        WorkerConfig.from_env({**env, "CGX_PS_QUORUM": "9"})
    with pytest.raises(ConfigError, match="CGX_PS_GRACE_MS"):
        WorkerConfig.from_env({**env, "CGX_PS_QUORUM": "3", "CGX_PS_GRACE_MS": "999999"})
    config = WorkerConfig.from_env({**env, "CGX_PS_QUORUM": "3", "CGX_PS_GRACE_MS": "20"})
    assert config.has_quorum and (config.quorum, config.grace_ms) == (3, 20)
    assert not WorkerConfig.from_env({**env, "CGX_PS_QUORUM": "4"}).has_quorum  # every node: no quorum


def test_a_round_waits_starts_its_grace_at_the_quorum_or_closes_when_only_nodes_behind_are_missing():
    rule = QuorumRule(nodes=4, quorum=3, grace_s=0.05)
    last = {"a": 9, "b": 9, "c": 9, "d": 9}  # every node pushed round 9: round 10 under way
    assert [rule.after_push("abc"[:n], last, 10, nodes_seen=4) for n in (1, 2, 3)] == ["wait", "wait", "grace"]
    assert rule.after_push("abc", last, 10, nodes_seen=3) == "wait"  # a node not up yet: the first rounds wait for all
    # d's latest push was round 9 (in time, or late once): it gets the grace; round 8 or older: it
    # is behind (stalled, or catching up), and waiting for it would only cost the grace again
    assert rule.after_push("abc", last, 10, nodes_seen=4) == "grace"
    assert rule.after_push("abc", {**last, "d": 8}, 10, nodes_seen=4) == "close"
    assert rule.after_push("abc", {**last, "d": 7}, 10, nodes_seen=4) == "close"
    assert rule.after_push("ab", {**last, "c": 5, "d": 5}, 10, nodes_seen=4) == "wait"  # below the quorum
    # d fetches round 10 instead of pushing it (a late node catching up skips the round under way):
    # the round does not wait for it
    assert rule.after_push("abc", last, 10, nodes_seen=4, skipping={"d": 0}) == "close"
    assert rule.after_push("ab", last, 10, nodes_seen=4, skipping={"d": 0}) == "wait"  # c may still come
    assert rule.after_push("abcd"[:3], last, 10, nodes_seen=4) == "grace"
    assert not QuorumRule(nodes=4).active
    assert QuorumRule(nodes=4, quorum=4).after_push("abc", last, 10, 4) == "wait"  # every node: no quorum


def test_a_late_node_catches_up_on_the_rounds_it_missed_and_skips_the_round_under_way():
    from cgx_ps.worker.pipeline.catch_up import catch_up_rounds

    assert catch_up_rounds(11, None) == 0  # in time: nothing to catch up
    # late on round 10 by a few ms, the block at round 11: skip 11, so the next compute starts
    # at 11's close as the others' does (else late again on every round, costing a grace each)
    assert catch_up_rounds(11, 11) == 1
    # stalled: the block moved on to round 20 meanwhile: rounds 11..19 closed, 20 under way
    assert catch_up_rounds(11, 20) == 10


def test_a_catching_up_node_waits_for_the_round_under_way_about_two_of_its_steps():
    from cgx_ps.worker.pipeline.catch_up import StepPace

    pace = StepPace(window=5)
    assert pace.under_way_wait_s(0.05) == 2.05  # no steps yet: 1 s assumed
    for t in (0.0, 0.1, 0.2, 1.3, 1.4, 1.5):  # 0.1 s steps, one of them with a 1 s stall
        pace.tick(t)
    assert abs(pace.under_way_wait_s(0.05) - 0.25) < 1e-9  # the median step, not the stall


def test_round_history_keeps_the_last_rounds_and_tells_a_late_push_from_a_retry():
    from cgx_ps.server.errors import BadRequest, WrongRound
    from cgx_ps.server.rounds.quorum import ClosedRound

    history = RoundHistory(keep=3)
    for r in range(5):
        history.add(ClosedRound(r, f"result-{r}", {"node-0": 0, "node-1": 0}, expected=2))
    with pytest.raises(WrongRound, match="keeps the last 3 rounds"):
        history.late_outcome(0, 5, "node-2", 0, 1)
    late = history.late_outcome(0, 5, "node-2", 0, 3)
    assert late.result == "result-3" and late.carry  # a late node's first push of round 3: carried
    history.get(3).late["node-2"] = 0
    assert not history.late_outcome(0, 5, "node-2", 0, 3).carry  # its retry: the result alone
    assert not history.late_outcome(0, 5, "node-0", 0, 4).carry  # pushed in time: a retry
    assert not history.late_outcome(0, 5, "node-2", 0, 4, fetch=True).carry
    with pytest.raises(BadRequest, match="member 0 of node node-0"):
        history.late_outcome(0, 5, "node-0", 1, 4)
    history.add(ClosedRound(7, "result-7", {}, expected=2))  # round 6 had no result (every node had left it)
    assert history.get(7).result == "result-7" and history.get(6) is None


def test_a_node_late_in_a_quarter_of_its_pushes_is_named_once_per_window():
    watch = LateWatch(window=8, share=0.25)
    said = [watch.note("node-3", late=(i % 3 == 0)) for i in range(24)]
    lines = [s for s in said if s]
    assert len(lines) == 3 and all("node node-3" in s for s in lines)  # once per window of 8 (24 pushes), not per push
    assert not any(watch.note("node-1", late=False) for _ in range(20))
    assert watch.total["node-3"] == 8


async def test_a_late_push_is_answered_with_its_rounds_result_and_carried_once_into_the_next_round(start_shard,
                                                                                                  tmp_path):
    """Exact, with fp32 blocks: round 1 closes with A and B (contributors 2); C's late push of
    round 1 gets that result and a LateNotice, and is carried into round 2 as the change it makes
    to round 1's average: round 2 averages A2, B2, C2 (contributors 3) plus (C1 - (A1 + B1) / 2) / 3,
    so over rounds 1 and 2 the nodes apply what they would have had C1 been in time; a retry of it
    is not carried again; a fetch of round 1 gets the same bytes. The timeline (shard and workers
    in this one process) shows the notice and the carried push."""
    import asyncio

    from cgx_ps import timeline

    from cgx_ps.kernels import Codec, contributors_of, dequantize, encode
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
    from cgx_ps.worker.shards.client import ShardClient
    from support import SECURITY

    recorder = timeline.start(timeline.Recorder(str(tmp_path / "trace.json"), "shard and workers"))
    shard = await start_shard(round_timeout_s=30)
    layout = build_layout([TensorInfo("w", (1000,))], 1, Compression(bits=None), block_bytes=1 << 20)
    block = layout.blocks[0].block_id
    clients = [ShardClient(f"127.0.0.1:{shard.port}", f"node-{i}", 3, layout, connect_timeout_s=5, security=SECURITY,
                           job_id="carry", quorum=2, grace_ms=100) for i in range(3)]
    try:
        for c in clients:
            await c.connect()
        grads = {(i, r): torch.randn(1000, generator=torch.Generator().manual_seed(10 * i + r)) for i in range(3)
                 for r in range(2)}

        def push(i: int, r: int) -> bytes:
            return encode(grads[(i, r)], Codec.FP32, bits=32, bucket_size=0).to_bytes()

        # every node's first round (a job's first rounds wait for every node), then round 1 without C
        first = await asyncio.gather(*[c.exchange(block, 0, push(i, 0)) for i, c in enumerate(clients)])
        assert contributors_of(first[0]) == 3 and len(set(map(bytes, first))) == 1
        a, b = await asyncio.gather(clients[0].exchange(block, 1, push(0, 1)), clients[1].exchange(block, 1, push(1, 1)))
        assert bytes(a) == bytes(b) and contributors_of(a) == 2  # closed by the grace, without C
        assert torch.equal(dequantize(bytes(a)), grads[(0, 1)] + grads[(1, 1)])
        late = await clients[2].exchange(block, 1, push(2, 1))  # C, late: round 1's bytes, at once
        assert bytes(late) == bytes(a)
        assert clients[2].stream.late == {block: 2}  # told the block is at round 2
        again = await clients[2].fetch(block, 1)
        assert bytes(again) == bytes(a)
        grads.update({(i, 2): torch.randn(1000, generator=torch.Generator().manual_seed(100 + i)) for i in range(3)})
        pushes = [encode(grads[(i, 2)], Codec.FP32, bits=32, bucket_size=0).to_bytes() for i in range(3)]
        results = await asyncio.gather(*[c.exchange(block, 2, pushes[i]) for i, c in enumerate(clients)])
        assert len(set(map(bytes, results))) == 1 and contributors_of(results[0]) == 3  # the three nodes in time
        in_time = {2: sum(grads[(i, 2)] for i in range(3)) / 3}
        round_1 = (grads[(0, 1)] + grads[(1, 1)]) / 2
        assert torch.allclose(dequantize(bytes(results[0])) / 3, in_time[2] + (grads[(2, 1)] - round_1) / 3,
                              atol=1e-5, rtol=0)
        # rounds 1 and 2 together: what they would have been with C1 in time (the same sum, one round later)
        applied = round_1 + dequantize(bytes(results[0])) / 3
        assert torch.allclose(applied, sum(grads[(i, 1)] for i in range(3)) / 3 + in_time[2], atol=1e-5, rtol=0)
        trace = timeline.load(timeline.stop(recorder))
        events = [(e["name"], e["args"]) for e in trace["traceEvents"] if e.get("ph") == "X"]
        assert [a for n, a in events if n == "late"] == [{"block": block, "next_round": 2, "step": 1}]
        assert [a for n, a in events if n == "carry"] == [{"block": block, "node": "node-2", "late_round": 1,
                                                          "step": 2}]  # once: the retry was not summed again
    finally:
        timeline.stop(recorder, write=False)
        for c in clients:
            await c.close()


def test_catch_up_with_refuses_what_it_cannot_step():
    import cgx_ps.worker as cgx

    model = torch.nn.Linear(4, 2)
    state = cgx.DDPHookState(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(cgx.CgxPsError, match="hook_state takes the DDPHookState"):
        cgx.catch_up_with(opt, hook_state=model)
    with pytest.raises(cgx.CgxPsError, match="takes the torch optimizer that steps the DDP model, got Linear"):
        cgx.catch_up_with(model, hook_state=state)
    cgx.catch_up_with(opt, hook_state=state)
    with pytest.raises(cgx.ConfigError, match="already called"):
        cgx.catch_up_with(opt, hook_state=state)
    opt.step()  # not registered with the shards yet: the post-hook has nothing to catch up on


def test_catch_up_with_refuses_a_scheduler_it_cannot_step_per_round():
    import cgx_ps.worker as cgx
    from cgx_ps.worker.frontends.schedulers import scheduler_problem

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    assert scheduler_problem(per_step, opt) is None
    assert "steps another optimizer" in scheduler_problem(per_step, other)
    assert "ReduceLROnPlateau steps on a metric" in scheduler_problem(
        torch.optim.lr_scheduler.ReduceLROnPlateau(opt), opt)
    assert "got function" in scheduler_problem(lambda: None, opt)
    assert scheduler_problem(per_step, copy.copy(opt)) is None  # DistributedOptimizer's: the same param_groups
    with pytest.raises(cgx.ConfigError, match="needs hook_state"):
        cgx.catch_up_with(opt, schedulers=[per_step])
    state = cgx.DDPHookState(model)
    with pytest.raises(cgx.ConfigError, match="cgx.catch_up_with: the LambdaLR given steps another optimizer"):
        cgx.catch_up_with(other, hook_state=state, schedulers=[per_step])
    assert state._catch_up is None  # refused whole: it can still be called right
    cgx.catch_up_with(opt, hook_state=state, schedulers=[per_step])
