"""Rounds against a real shard, shared by the test_server*.py files: the test model's layout,
random pushes of every block by every client, the check of an aggregate against the exact sum,
and an Exchange stream driven by hand with the status it must end with."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from cgx_ps.kernels import dequantize, encode
from cgx_ps.model_layout import codec_of
from cgx_ps.server import ShardServer
from cgx_ps.server.rounds.aggregator import result_seed
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker.shards.client import ShardClient
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
from support import METADATA


TENSORS = [TensorInfo("a.weight", (300, 70)), TensorInfo("a.bias", (300,)),
           TensorInfo("b.weight", (64, 1000)), TensorInfo("c.weight", (50, 41))]
COMPRESSION = Compression(bits=4, bucket_size=512, overrides={"c.*": 2})


def make_layout(tensors=TENSORS, compression=COMPRESSION, block_bytes=64 << 10, shards=1) -> ps_pb2.Layout:
    return build_layout(tensors, shards, compression, block_bytes=block_bytes)


async def close(clients: list[ShardClient]) -> None:
    for c in clients:
        await c.close()


def encode_block(block: ps_pb2.BlockSpec, values: torch.Tensor, seed: int) -> bytes:
    s = block.codec
    return encode(values, codec_of(s), bits=s.bits, bucket_size=s.bucket_size, stochastic=s.stochastic,
                  seed=seed).to_bytes()


async def run_round(clients, layout, round_, seed=0):
    """Every client pushes a random block for every block id; returns (pushed payloads, results)."""
    pushed: dict[int, list[bytes]] = {}
    gen = torch.Generator().manual_seed(seed + round_)
    for block in layout.blocks:
        pushed[block.block_id] = [encode_block(block, torch.randn(block.numel, generator=gen), seed=k)
                                  for k in range(len(clients))]
    results = await asyncio.gather(*[
        asyncio.gather(*[c.exchange(b.block_id, round_, pushed[b.block_id][k]) for b in layout.blocks])
        for k, c in enumerate(clients)])
    return pushed, results


def check_aggregate(block: ps_pb2.BlockSpec, payloads: list[bytes], result: bytes, round_: int = 0) -> None:
    exact = sum(dequantize(p) for p in payloads)
    got = dequantize(result)
    if len(payloads) <= 2:  # a + b == b + a: the server's float32 sum is known exactly
        assert result == encode_block(block, exact, result_seed(block.block_id, round_))
    if block.codec.codec == ps_pb2.CODEC_FP32:
        torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
    else:
        # the sum re-quantized once: within one unit of the result's own buckets
        header_units = torch.from_numpy(
            __import__("numpy").frombuffer(result, dtype="<f4", offset=32,
                                           count=2 * -(-block.numel // block.codec.bucket_size))[1::2].copy())
        unit = header_units.repeat_interleave(block.codec.bucket_size)[: block.numel]
        assert bool(((got - exact).abs() <= unit * 1.0001 + 1e-6).all())


async def raw_stream(open_channel, server: ShardServer, node: str, layout: ps_pb2.Layout, session_id: str = ""):
    """An Exchange stream we drive by hand, as the member ``node`` of the session ``session_id``,
    on a channel from the ``open_channel`` fixture (closed after the test, also one that failed)."""
    channel = open_channel(f"127.0.0.1:{server.port}")
    call = ps_pb2_grpc.ParameterServerStub(channel).Exchange(metadata=METADATA)
    from cgx_ps.model_layout import layout_hash
    await call.write(ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id=node, layout_hash=layout_hash(layout),
                                                               session_id=session_id)))
    return channel, call


async def expect_status(call, code: grpc.StatusCode, match: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details(), info.value.details()


def _good(block: ps_pb2.BlockSpec) -> bytes:
    return encode_block(block, torch.randn(block.numel), 0)
