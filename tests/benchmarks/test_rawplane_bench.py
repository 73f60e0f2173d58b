"""benchmarks/rawplane.py, the raw data plane benchmarks/dataplane.py measures gRPC against: its
figures are honest only if it does the shard's own work. Over it, a round gives the shard's exact
sum to the shipped clients (ShardClient on CGX_PS_DATAPLANE=raw, the port advertised at Register
as the benchmark's shard advertises it), and what the gRPC shard refuses (a wrong token, a corrupt
push, an oversized message) is refused too, with the same status. A real in-process shard (gRPC
for Register) and the raw listener beside it, on port 0; the refusals on connections driven by
hand (test_stream_context.RawClient)."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import pytest
import torch

from benchmarks.rawplane import MAX_FRAME, raw_plane_client, serve_raw
from cgx_ps.model_layout import layout_hash
from cgx_ps.server import ShardServer
from cgx_ps.v1 import ps_pb2
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo
from cgx_ps.worker.shards.client import ShardClient
from rounds import check_aggregate, close, encode_block, make_layout
from support import SECURITY
from test_stream_context import TOKEN, WRONG, RawClient

SHARD_SETTINGS = dict(round_timeout_s=5.0)
LAYOUT = make_layout([TensorInfo("w", (64, 64))], Compression(bits=4, bucket_size=512))


@pytest.fixture(params=["sock", "protocol"])  # the shard's two receive paths (rawplane.serve_raw)
async def raw(shard: ShardServer, request):
    port, acceptor = await serve_raw(shard.service, shard.token, "127.0.0.1", io=request.param)
    shard.service.data_port = port  # advertised at Register, as the benchmark's shard process does
    yield shard, port
    acceptor.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await acceptor


async def _members(shard: ShardServer, port: int, n: int) -> list[ShardClient]:
    clients = [raw_plane_client(f"127.0.0.1:{shard.port}", f"n{i}", n, LAYOUT, SECURITY, port) for i in range(n)]
    for c in clients:
        await c.connect()
    return clients


async def test_a_round_over_the_raw_plane_gives_every_node_the_shards_exact_sum(raw) -> None:
    shard, port = raw
    clients = await _members(shard, port, 2)
    block = LAYOUT.blocks[0]
    try:
        payloads = [encode_block(block, torch.randn(block.numel), seed) for seed in (1, 2)]
        results = await asyncio.wait_for(asyncio.gather(*(c.exchange(0, 0, p) for c, p in zip(clients, payloads))),
                                         10)
        assert bytes(results[0]) == bytes(results[1])
        check_aggregate(block, payloads, bytes(results[0]))
        assert shard.metrics.registry.get_sample_value("cgx_ps_exchange_streams", {"shard": "0", "plane": "raw"}) == 2
    finally:
        await close(clients)


def _hello(node: str, session_id: str) -> bytes:
    return ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id=node, layout_hash=layout_hash(LAYOUT),
                                                     session_id=session_id)).SerializeToString()


def _garbage_push() -> bytes:
    size = len(encode_block(LAYOUT.blocks[0], torch.zeros(LAYOUT.blocks[0].numel), 1))
    return ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(round=0, block_id=0, total_bytes=size, offset=0,
                                                        data=b"\x07" * size)).SerializeToString()


@pytest.mark.parametrize("case", ["wrong token", "corrupt push", "oversized frame"])
async def test_the_raw_plane_refuses_what_the_grpc_shard_refuses(raw, case: str) -> None:
    shard, port = raw
    (member,) = await _members(shard, port, 1)
    try:
        call = await RawClient.open(port, WRONG if case == "wrong token" else TOKEN)
        await call.send(_hello(member.node_id, member.session_id))
        if case == "corrupt push":
            await call.send(_garbage_push())
            code, match = "INVALID_ARGUMENT", "not a cgx-ps block"
        elif case == "oversized frame":  # announced only: refused before a byte of it is buffered
            call.writer.write(struct.pack("<I", MAX_FRAME + 1))
            code, match = "INVALID_ARGUMENT", f"at most {MAX_FRAME}"
        else:
            code, match = "UNAUTHENTICATED", "token"
        ending = await asyncio.wait_for(call.ending(), 10)
        assert ending[0] == code and match in ending[1], ending
        call.writer.close()
    finally:
        await close([member])
