"""Adaptive bits and auto mode under quorum rounds: a stalled node's catch-up applies the tuner's
decisions it missed (every rank the same broadcasts, settings and compression at every round),
and a late push encoded with its own round's settings is carried after SetCodecs changed them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from support import env_for, free_port, wait_until_stopped

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests/workers/quorum_worker.py"


async def test_a_late_push_encoded_before_two_setcodecs_changes_is_carried_into_the_round_under_way(start_shard):
    """Rank 0 announces new bits before each round (3, 2, 5, 6 bits in rounds 1..4); node C stalls
    in round 1, which closes without it, and so do rounds 2 and 3. C's late push of round 1, in
    round 1's 3 bits, is checked against round 1's settings (which the shard keeps as long as it
    keeps round 1's result for late nodes) and summed into round 4 with A's and B's 6-bit pushes."""
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
        assert bytes(results[0]) == bytes(results[1]) and contributors_of(results[0]) == 3  # A4 + B4 + C's round 1
        expected = sum(dequantize(p) for p in (push(0, 4, 6), push(1, 4, 6), push(2, 1, 3)))
        got = dequantize(bytes(results[0]))
        unit = (expected.max() - expected.min()) / 63  # the result's 6-bit step, at most, per bucket
        assert torch.allclose(got, expected, atol=float(unit), rtol=0)
    finally:
        for c in clients:
            await c.close()
