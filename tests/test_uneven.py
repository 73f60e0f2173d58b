"""Uneven inputs: a node that ran out of data leaves the rounds (ps.proto PushChunk.out_of_data,
server/rounds/uneven.py); the rounds close without waiting for it, divide by the gradients they
sum, and end the epoch when every node has left."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from cgx_ps.kernels import Codec, contributors_of, dequantize, encode
from cgx_ps.worker import join
from cgx_ps.worker.errors import CgxPsError
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
from cgx_ps.worker.shards.client import ShardClient
from support import SECURITY, env_for
from workers.warm_start import start_worker

NUMEL = 1000
WORKER = Path(__file__).resolve().parent / "workers/join_worker.py"


def grad(node: int, round_: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * node + round_))


def push(node: int, round_: int) -> bytes:
    return encode(grad(node, round_), Codec.FP32, bits=32, bucket_size=0).to_bytes()


async def clients_for(shard, job: str, nodes: int = 3, **quorum) -> tuple[list[ShardClient], int]:
    layout = build_layout([TensorInfo("w", (NUMEL,))], 1, Compression(bits=None), block_bytes=1 << 20)
    clients = [ShardClient(f"127.0.0.1:{shard.port}", f"node-{i}", nodes, layout, connect_timeout_s=5,
                           security=SECURITY, job_id=job, **quorum) for i in range(nodes)]
    for c in clients:
        await c.connect()
    return clients, layout.blocks[0].block_id


@pytest.mark.parametrize("quorum", [{}, {"quorum": 2, "grace_ms": 5000}])
async def test_rounds_go_on_without_a_node_out_of_data_and_end_when_every_node_has_left(start_shard, quorum):
    """Exact, with fp32 blocks: round 0 with every node; round 1 without C (out of data): the sum
    of A and B, contributors 2, the same bytes for C, at once (no timeout, no grace); round 2, A
    out of data too; round 3, every node out of data: no result, each told; round 4, a new epoch,
    every node again."""
    shard = await start_shard(round_timeout_s=30)
    clients, block = await clients_for(shard, f"uneven-{len(quorum)}", **quorum)
    a, b, c = clients
    try:
        first = await asyncio.gather(*[cl.exchange(block, 0, push(i, 0)) for i, cl in enumerate(clients)])
        assert len(set(map(bytes, first))) == 1
        started = asyncio.get_running_loop().time()
        one = await asyncio.gather(a.exchange(block, 1, push(0, 1)), b.exchange(block, 1, push(1, 1)),
                                   c.fetch(block, 1, out_of_data=True))
        assert asyncio.get_running_loop().time() - started < 2  # neither the round timeout nor the grace
        assert len(set(map(bytes, one))) == 1 and contributors_of(one[0]) == 2
        assert torch.equal(dequantize(bytes(one[0])), grad(0, 1) + grad(1, 1))
        two = await asyncio.gather(a.fetch(block, 2, out_of_data=True), b.exchange(block, 2, push(1, 2)),
                                   c.fetch(block, 2, out_of_data=True))
        assert len(set(map(bytes, two))) == 1 and contributors_of(two[0]) == 1
        assert torch.equal(dequantize(bytes(two[0])), grad(1, 2))
        three = await asyncio.gather(*[cl.fetch(block, 3, out_of_data=True) for cl in clients])
        assert [bytes(r) for r in three] == [b""] * 3  # every node has left: no result, each told
        four = await asyncio.gather(*[cl.exchange(block, 4, push(i, 4)) for i, cl in enumerate(clients)])
        assert len(set(map(bytes, four))) == 1  # the next epoch: every node, every gradient
        assert contributors_of(four[0]) in (0, 3)
        assert torch.allclose(dequantize(bytes(four[0])), grad(0, 4) + grad(1, 4) + grad(2, 4), atol=1e-5, rtol=0)
    finally:
        for cl in clients:
            await cl.close()


async def test_a_round_every_node_left_still_carries_a_late_gradient_into_it(start_shard):
    """Quorum rounds: C's push of round 1 comes after the round closed without it, and is
    carried into round 2, which every node then pushes out of data: round 2's result is C's
    correction alone (contributors 1), the change C1 makes to round 1's average of A1 and B1,
    (C1 - (A1 + B1) / 2) / 3, encoded as the block's settings say; round 3 ends the epoch."""
    shard = await start_shard(round_timeout_s=30)
    clients, block = await clients_for(shard, "uneven-carried", quorum=2, grace_ms=50)
    a, b, c = clients
    try:
        await asyncio.gather(*[cl.exchange(block, 0, push(i, 0)) for i, cl in enumerate(clients)])
        closed = await asyncio.gather(a.exchange(block, 1, push(0, 1)), b.exchange(block, 1, push(1, 1)))
        assert contributors_of(closed[0]) == 2
        assert bytes(await c.exchange(block, 1, push(2, 1))) == bytes(closed[0])  # late: carried into round 2
        two = await asyncio.gather(*[cl.fetch(block, 2, out_of_data=True) for cl in clients])
        assert len(set(map(bytes, two))) == 1 and contributors_of(two[0]) == 1
        correction = (grad(2, 1) - dequantize(bytes(closed[0])) / 2) / 3
        assert torch.allclose(dequantize(bytes(two[0])), correction, atol=1e-6, rtol=0)
        three = await asyncio.gather(*[cl.fetch(block, 3, out_of_data=True) for cl in clients])
        assert [bytes(r) for r in three] == [b""] * 3
    finally:
        for cl in clients:
            await cl.close()


async def test_a_gradient_from_a_node_that_left_is_refused_naming_it(start_shard):
    shard = await start_shard(round_timeout_s=30)
    clients, block = await clients_for(shard, "uneven-refused", nodes=2)
    a, b = clients
    try:
        await asyncio.gather(a.exchange(block, 0, push(0, 0)), b.fetch(block, 0, out_of_data=True))
        with pytest.raises(CgxPsError, match="node node-1 left the rounds at round 0"):
            await asyncio.wait_for(b.exchange(block, 1, push(1, 1)), 10)
    finally:
        for cl in clients:
            await cl.close()


def run_nodes(cluster, batches: list[int], timeout: float = 240, **env: str) -> list[dict]:
    job = {"CGX_PS_JOB_ID": f"uneven-{uuid.uuid4().hex[:8]}", **env}
    procs = [start_worker([sys.executable, str(WORKER), "--batches", str(n)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env_for(r, len(batches), cluster.addresses, **job))
             for r, n in enumerate(batches)]
    outs = [proc.communicate(timeout=timeout) for proc in procs]
    failed = [f"node {r} exit {proc.returncode}:\n{err[-3000:]}" for r, (proc, (_, err)) in enumerate(zip(procs, outs))
              if proc.returncode != 0]
    assert not failed, "\n".join(failed)
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.slow
@pytest.mark.parametrize("batches, quorum", [([5, 8], {}), ([4, 6, 9], {"CGX_PS_QUORUM": "2", "CGX_PS_GRACE_MS": "20"})])
def test_uneven_inputs_end_every_epoch_quickly_with_bit_identical_replicas(local_cluster, batches, quorum):
    cluster = local_cluster(2, round_timeout=30)
    results = run_nodes(cluster, batches, **quorum)
    epochs = 2
    assert [r["computed"] for r in results] == [epochs * n for n in batches]
    # every node took the longest node's steps (its own and shadow steps): round ids stay aligned,
    # and the second epoch started with every node again (under a quorum, a late node's gradient
    # carried past the end of an epoch may add a round to it, on every node alike)
    steps = {r["steps"] for r in results}
    assert len(steps) == 1, results
    assert steps == {epochs * max(batches)} if not quorum else epochs * max(batches) <= steps.pop() <= epochs * (
        max(batches) + 2), results
    assert len({r["digest"] for r in results}) == 1, results  # parameters and momentum bit-identical
    # no round waited for the round timeout (30 s): 2 x 8 steps of 20 ms, the shadow steps
    assert all(r["train_s"] < 10 for r in results), results
    assert all(r["refusals"] == ["this optimizer is already inside cgx.join: a node leaves the rounds once per epoch"]
               for r in results), results


def test_join_refuses_what_is_not_a_distributed_optimizer():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(CgxPsError, match="takes a DistributedOptimizer, got SGD"):
        with join(opt):
            pass
