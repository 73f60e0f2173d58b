"""Adaptive bits and auto mode under quorum rounds: a stalled node's catch-up applies the tuner's
decisions it missed (every rank the same broadcasts, settings and compression at every round),
and a late push encoded with its own round's settings is carried after SetCodecs changed them."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from support import env_for, free_port
from test_quorum import start_nodes
from test_quorum_local import finish, steps_done, stop_then_continue

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests/workers/quorum_worker.py"

CLUSTER_SETTINGS = dict(shards=2, round_timeout=30)  # the refusal test's shards (conftest.cluster)


async def test_a_late_push_encoded_before_two_setcodecs_changes_is_carried_into_the_round_under_way(start_shard):
    """Rank 0 announces new bits before each round (3, 2, 5, 6 bits in rounds 1..4); node C stalls
    in round 1, which closes without it, and so do rounds 2 and 3. C's late push of round 1, in
    round 1's 3 bits, is checked against round 1's settings (which the shard keeps as long as it
    keeps round 1's result for late nodes) and carried into round 4 with A's and B's 6-bit pushes,
    as the change it makes to round 1's average (rounds/late_rounds.py)."""
    import asyncio

    from cgx_ps.kernels import contributors_of, dequantize, quantize
    from cgx_ps.v1 import ps_pb2
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
    from cgx_ps.worker.shards.client import ShardClient
    from support import SECURITY

    shard = await start_shard(round_timeout_s=30)
    layout = build_layout([TensorInfo("w", (64, 64))], 1, Compression(bits=4, bucket_size=256), block_bytes=1 << 20)
    spec = layout.blocks[0]
    block = spec.block_id
    job = f"late-settings-{uuid.uuid4().hex[:6]}"
    clients = [ShardClient(f"127.0.0.1:{shard.port}", f"node-{i}", 3, layout, connect_timeout_s=5, security=SECURITY,
                           job_id=job, quorum=2, grace_ms=50) for i in range(3)]
    grads = {(i, r): torch.randn(4096, generator=torch.Generator().manual_seed(10 * i + r)) for i in range(3)
             for r in range(5)}

    def push(i: int, r: int, bits: int) -> bytes:
        return bytes(quantize(grads[(i, r)], bits, 256, stochastic=True, seed=10 * i + r).to_bytes())

    def codec(bits: int) -> list[ps_pb2.BlockCodec]:
        return [ps_pb2.BlockCodec(block_id=block, codec=ps_pb2.CodecSettings(
            codec=ps_pb2.CODEC_MAXMIN, bits=bits, bucket_size=256, stochastic=True))]

    try:
        for c in clients:
            await c.connect()
        await asyncio.gather(*[c.exchange(block, 0, push(i, 0, 4)) for i, c in enumerate(clients)])
        bits = {1: 3, 2: 2, 3: 5, 4: 6}  # each round's, announced by rank 0 before it
        for round_ in (1, 2, 3):  # C stalls: A and B push, each round closes without it
            await clients[0].set_codecs(round_, codec(bits[round_]))
            await asyncio.gather(*[clients[i].exchange(block, round_, push(i, round_, bits[round_])) for i in (0, 1)])
        await clients[0].set_codecs(4, codec(bits[4]))
        # C wakes up: its push of round 1 in round 1's 3 bits, late: round 1's result, carried
        late = await clients[2].exchange(block, 1, push(2, 1, 3))
        assert contributors_of(late) == 2 and clients[2].stream.late == {block: 4}
        results = await asyncio.gather(clients[0].exchange(block, 4, push(0, 4, 6)),
                                       clients[1].exchange(block, 4, push(1, 4, 6)))
        assert bytes(results[0]) == bytes(results[1]) and contributors_of(results[0]) == 2  # A4 + B4, in time
        # + C's round 1, as its change to round 1's average (of 3 expected), times the divisor 2
        correction = 2 * (dequantize(push(2, 1, 3)) - dequantize(bytes(late)) / 2) / 3
        expected = dequantize(push(0, 4, 6)) + dequantize(push(1, 4, 6)) + correction
        got = dequantize(bytes(results[0]))
        unit = (expected.max() - expected.min()) / 63  # the result's 6-bit step, at most, per bucket
        assert torch.allclose(got, expected, atol=float(unit), rtol=0)
    finally:
        for c in clients:
            await c.close()


def test_the_codec_schedule_keeps_the_settings_of_every_round_a_late_push_may_still_come_for():
    from cgx_ps.server.rounds.block_state import prune_schedule
    from cgx_ps.v1 import ps_pb2

    bits = lambda b: ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=b, bucket_size=512)  # noqa: E731
    schedule = []
    for round_ in range(1, 41):  # a change every round; the block at round_ when it comes
        oldest = round_ - 16  # under a quorum: the oldest closed round kept for late nodes
        schedule = prune_schedule(schedule, oldest, round_) + [(round_, bits(2 + round_ % 7))]
    # rounds 24..40 each have their entry; none older is kept: bounded by the rounds kept
    assert [r for r, _ in schedule] == list(range(24, 41))
    assert [r for r, _ in prune_schedule(schedule, 39, 41)] == [39, 40]  # without a quorum: the previous round's


def run_with_a_stall(cluster, tmp_path: Path, args: list[str], steps: int, stop_at: int = 5, node: int = 2,
                     **env: str) -> list[dict]:
    """3 nodes train ``steps`` steps with ``args``, CGX_PS_QUORUM=2; ``node`` SIGSTOPs itself before its
    step ``stop_at`` (or the first later one of its parity: the worker's --sigstop-at-step) and catches
    up after SIGCONT. Each node's JSON line.

    Node 2 stays stopped until the others have finished 10 rounds without it (their progress files):
    several decision boundaries, and fewer rounds than the 16 a shard keeps for late nodes, however
    fast or slow the machine runs the others' rounds. Rank 0 (node 0) holds the others at its next
    decision, so it stays stopped 1 s: 10 or more of the others' rounds, were they not held."""
    progress = [tmp_path / f"progress{r}" for r in range(3)]
    procs = start_nodes(cluster, 3, lambda r: ["--steps", str(steps), "--progress", str(progress[r]), *args]
                        + (["--sigstop-at-step", str(stop_at)] if r == node else []),
                        tmp_path, CGX_PS_QUORUM="2", CGX_PS_GRACE_MS="20", **env)
    if node == 0:
        stop_then_continue(procs, node, 1.0)
    else:  # the stopped node's file holds its steps (it may have caught up on rounds before it stopped)
        stop_then_continue(procs, node, 60.0,
                           until=lambda: steps_done(progress[0]) >= steps_done(progress[node]) + 10)
    return finish(procs)


def assert_in_step(results: list[dict], steps: int, interval: int) -> None:
    """Every node ends as one: the same steps, parameters (and momentum), tuner decisions, block
    settings, compression and checkpoint state, though node 2 caught up on rounds holding
    decisions instead of computing them."""
    assert [r["steps"] for r in results] == [steps] * 3
    for key in ("digest", "decisions", "bits", "compress", "checkpoint"):
        assert len({json.dumps(r[key]) for r in results}) == 1, (key, [r[key] for r in results])
    assert len(results[0]["decisions"]) >= steps // interval - 1
    caught_up = results[2]["caught_up"]
    assert results[2]["computed"] < min(r["computed"] for r in results[:2]), results
    # several of the tuner's decision boundaries (after step s, (s + 1) % interval == 0) fell in the
    # rounds node 2 applied without computing them
    assert sum(1 for s in caught_up if (s + 1) % interval == 0) >= 2, caught_up


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["optimizer", "ddp hook"])
def test_adaptive_bits_decided_while_a_node_is_stalled_reach_it_as_it_catches_up(local_cluster, tmp_path, front_end):
    cluster = local_cluster(2, round_timeout=30)
    ddp = ["--ddp"] if front_end == "ddp hook" else []
    gloo = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())) if ddp else {}
    steps = 30
    results = run_with_a_stall(cluster, tmp_path, ["--compression", "adaptive:2", *ddp], steps, stop_at=7,
                               **gloo)
    assert_in_step(results, steps, 2)
    # the worker's data makes the bits swing every 4 steps: some changed (SetCodecs) at decisions
    # node 2 applied while catching up, and its late push (stopped in round 7, at 2 and 5 bits)
    # reached the shards after two more changes (the shards keep its round's settings)
    decisions = results[0]["decisions"]
    changed = [d["from_round"] - 1 for prev, d in zip(decisions, decisions[1:]) if d["bits"] != prev["bits"]]
    assert sum(1 for s in changed if s in results[2]["caught_up"]) >= 2, (changed, results[2]["caught_up"])
    params = [torch.load(tmp_path / f"n{r}.pt") for r in range(3)]
    assert all(torch.equal(params[0][k], p[k]) for p in params[1:] for k in params[0])


@pytest.mark.slow
def test_a_stalled_rank_0_holds_the_others_at_the_next_decision_and_decides_as_it_catches_up(local_cluster,
                                                                                              tmp_path):
    # rank 0 stops before its step 6: the others close rounds 6 and 7 without it, then wait for
    # its decision after step 7; it pushes round 6 late, and decides after step 7 as it applies
    # that round without computing it, then skips round 8 (under way) as any late node does
    cluster = local_cluster(2, round_timeout=30)
    steps = 20
    results = run_with_a_stall(cluster, tmp_path, ["--compression", "adaptive:2"], steps, stop_at=6, node=0)
    assert [r["steps"] for r in results] == [steps] * 3
    for key in ("digest", "decisions", "bits", "checkpoint"):
        assert len({json.dumps(r[key]) for r in results}) == 1, (key, [r[key] for r in results])
    caught_up = results[0]["caught_up"]
    assert any(s % 2 == 1 for s in caught_up), caught_up  # a decision made by rank 0 while catching up
    # the others waited for it there: it caught up on a few rounds, not on the 10 or more of its 1 s
    # stop (each node may also be late now and then by the 20 ms grace on a loaded machine: a round
    # or two each time, hence the margin)
    assert len(caught_up) <= 6, results


@pytest.mark.slow
def test_auto_mode_through_the_shards_switches_while_a_node_is_stalled_and_the_node_follows(local_cluster, tmp_path):
    cluster = local_cluster(2, round_timeout=30)
    steps = 36
    results = run_with_a_stall(cluster, tmp_path, ["--compression", "auto:2", "--via", "shards"], steps)
    assert_in_step(results, steps, 2)
    modes = [d["compress"] for d in results[0]["decisions"]]
    assert any(a != b for a, b in zip(modes, modes[1:])), modes  # a switch, which node 2 applied alike


def test_auto_mode_with_uncompressed_steps_on_an_allreduce_is_refused_under_a_quorum(cluster, tmp_path):
    env = env_for(0, 2, cluster.addresses, CGX_PS_JOB_ID=f"qtune-{uuid.uuid4().hex[:8]}", CGX_PS_QUORUM="1")
    done = subprocess.run([sys.executable, str(WORKER), "--out", str(tmp_path / "n0.pt"), "--compression", "auto",
                           "--via", "allreduce"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    refused = json.loads(done.stdout.strip().splitlines()[-1])["refused"]
    assert refused.startswith('CGX_PS_QUORUM=1 with compression="auto" needs uncompressed_via="shards"'), refused
    assert "all_reduce, which waits for every rank" in refused


def test_late_gradients_are_weighted_as_their_share_of_the_round_they_were_late_for():
    from cgx_ps.server.rounds.late_rounds import correction_weights, expected_gradients, result_divisor

    assert expected_gradients(8, left={}, absent=set()) == 8
    assert expected_gradients(8, left={"a": 3, "b": 5}, absent={"b"}) == 6  # b left in this round
    assert expected_gradients(2, left={"a": 1, "b": 1}, absent={"a", "b"}) == 1  # never 0
    assert result_divisor(7, carried=1) == 7 and result_divisor(0, carried=2) == 1 and result_divisor(0, 0) == 0
    # round t: 7 of 8 in time; the 8th, late, into a round of 7 in time: 7 (g - sum_t / 7) / 8 in its sum
    assert correction_weights(7, expected=8, closed_contributors=7) == (7 / 8, -1 / 8)
    assert correction_weights(4, expected=5, closed_contributors=2) == (4 / 5, -2 / 5)


class Fp32Job:
    """``nodes`` ShardClients of one quorum-2 job on a shard, one fp32 block of ``numel``, and each
    node's seeded gradient per round: a late push's arithmetic is exact."""

    def __init__(self, shard, nodes: int, numel: int) -> None:
        from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
        from cgx_ps.worker.shards.client import ShardClient
        from support import SECURITY

        layout = build_layout([TensorInfo("w", (numel,))], 1, Compression(bits=None), block_bytes=1 << 20)
        self.block, job = layout.blocks[0].block_id, f"fp32-late-{uuid.uuid4().hex[:6]}"
        self.clients = [ShardClient(f"127.0.0.1:{shard.port}", f"node-{i}", nodes, layout, connect_timeout_s=5,
                                    security=SECURITY, job_id=job, quorum=2, grace_ms=50) for i in range(nodes)]
        self.grads = {(i, r): torch.randn(numel, generator=torch.Generator().manual_seed(10 * i + r))
                      for i in range(nodes) for r in range(4)}

    def push(self, i: int, r: int) -> bytes:
        from cgx_ps.kernels import Codec, encode

        return encode(self.grads[(i, r)], Codec.FP32, bits=32, bucket_size=0).to_bytes()

    async def exchange(self, nodes, round_: int, payloads: dict[int, bytes] | None = None) -> list:
        """Each of ``nodes`` pushes ``round_`` (its gradient, or ``payloads[node]``) at once; their results."""
        import asyncio

        payloads = payloads or {}
        return await asyncio.gather(*[self.clients[i].exchange(self.block, round_, payloads.get(i) or self.push(i, round_))
                                      for i in nodes])

    async def __aenter__(self) -> "Fp32Job":
        for c in self.clients:
            await c.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self.clients:
            await c.close()


async def test_two_late_gradients_of_a_round_make_it_the_average_of_all_four_one_round_later(start_shard):
    """fp32, 4 nodes, quorum 2: round 1 closes with A and B; C's and D's pushes of it come late and
    are carried into round 2. Rounds 1 and 2 together then apply exactly the average of all four
    round-1 gradients plus round 2's own average: nothing lost, nothing weighted twice."""
    from cgx_ps.kernels import contributors_of, dequantize

    async with Fp32Job(await start_shard(round_timeout_s=30), 4, 500) as job:
        await job.exchange(range(4), 0)
        one = await job.exchange((0, 1), 1)
        assert contributors_of(one[0]) == 2
        for i in (2, 3):  # late, one after the other: each gets round 1's result
            assert bytes((await job.exchange((i,), 1))[0]) == bytes(one[0])
        two = await job.exchange(range(4), 2)
        assert len(set(map(bytes, two))) == 1 and contributors_of(two[0]) == 4
        applied = dequantize(bytes(one[0])) / 2 + dequantize(bytes(two[0])) / 4
        exact = sum(job.grads[(i, 1)] for i in range(4)) / 4 + sum(job.grads[(i, 2)] for i in range(4)) / 4
        assert torch.allclose(applied, exact, atol=1e-5, rtol=0)


async def test_a_late_gradient_of_a_round_every_scaler_skipped_and_an_overflowed_one_are_not_carried(start_shard):
    """fp32, 3 nodes, quorum 2. Round 1: A overflowed (a non-finite push), so the result every
    node's loss scaler skips is non-finite; C's finite push of it comes late and corrects nothing
    (no node applied round 1). Round 2: C's overflowed push comes late, and is not carried either.
    Rounds 2 and 3 are then exactly the averages of their gradients in time."""
    from cgx_ps.kernels import Codec, contributors_of, decode_header, dequantize, non_finite_block

    overflowed = non_finite_block(Codec.FP32, 32, 0, 300).to_bytes()
    async with Fp32Job(await start_shard(round_timeout_s=30), 3, 300) as job:
        await job.exchange(range(3), 0)
        one = await job.exchange((0, 1), 1, {0: overflowed})
        assert decode_header(bytes(one[0])).non_finite
        assert bytes((await job.exchange((2,), 1))[0]) == bytes(one[0])  # late: the same bytes
        two = await job.exchange((0, 1), 2)
        assert contributors_of(two[0]) == 2
        assert torch.allclose(dequantize(bytes(two[0])), job.grads[(0, 2)] + job.grads[(1, 2)], atol=1e-6, rtol=0)
        assert bytes((await job.exchange((2,), 2, {2: overflowed}))[0]) == bytes(two[0])  # late, overflowed
        three = await job.exchange(range(3), 3)
        assert contributors_of(three[0]) == 3
        assert torch.allclose(dequantize(bytes(three[0])), sum(job.grads[(i, 3)] for i in range(3)), atol=1e-6,
                              rtol=0)
