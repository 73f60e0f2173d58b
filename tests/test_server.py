"""Real shards on port 0, real gRPC clients: rounds. The aggregate is the sum and identical for
all nodes, at every encoding, chunking and codec change; missing nodes fail the round for
everyone; duplicates, reconnects and retried Registers change nothing.

Bad input is in test_server_bad_input.py; backpressure, metrics, health, blobs, draining and the
server binary in test_server_operations.py."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request

import grpc
import pytest
import torch

from cgx_ps.kernels import Codec, dequantize, encode
from cgx_ps.server import ServerConfig, ShardServer
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker.shards.client import ShardClient
from cgx_ps.worker.errors import RoundFailedError
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo
from rounds import _good, check_aggregate, close, encode_block, expect_status, make_layout, raw_stream, run_round
from support import METADATA, SECURITY, connect

SHARD_SETTINGS = dict(metrics_port=0, round_timeout_s=5.0)  # the conftest `shard` fixture's


@pytest.mark.parametrize("nodes", [1, 2, 3])
async def test_aggregate_is_the_sum_and_identical_for_all_nodes(shard: ShardServer, nodes: int) -> None:
    layout = make_layout()
    assert {b.codec.codec for b in layout.blocks} == {ps_pb2.CODEC_FP32, ps_pb2.CODEC_MAXMIN}
    assert {b.codec.bits for b in layout.blocks if b.codec.codec == ps_pb2.CODEC_MAXMIN} == {2, 4}
    clients = await connect(shard, layout, nodes)
    try:
        for round_ in range(3):
            pushed, results = await run_round(clients, layout, round_)
            for i, block in enumerate(layout.blocks):
                per_node = [results[k][i] for k in range(nodes)]
                assert all(r == per_node[0] for r in per_node)  # identical bytes
                check_aggregate(block, pushed[block.block_id], per_node[0], round_)
    finally:
        await close(clients)


@pytest.mark.parametrize("fallback", [ps_pb2.CODEC_FP16, ps_pb2.CODEC_BF16])
async def test_half_precision_blocks(shard: ShardServer, fallback: int) -> None:
    layout = make_layout(compression=Compression(bits=None, fallback=fallback), block_bytes=32 << 10)
    clients = await connect(shard, layout, 2)
    try:
        pushed, results = await run_round(clients, layout, 0)
        for i, block in enumerate(layout.blocks):
            exact = sum(dequantize(p) for p in pushed[block.block_id])
            dtype = torch.float16 if fallback == ps_pb2.CODEC_FP16 else torch.bfloat16
            assert torch.equal(dequantize(results[0][i]), exact.to(dtype).float())
    finally:
        await close(clients)


async def test_blocks_larger_than_one_chunk(shard: ShardServer) -> None:
    layout = make_layout([TensorInfo("big.weight", (1024, 1100))], Compression(bits=None), block_bytes=8 << 20)
    assert layout.blocks[0].numel * 4 > 4 << 20  # several 1 MiB chunks each way
    clients = await connect(shard, layout, 2)
    try:
        pushed, results = await run_round(clients, layout, 0)
        check_aggregate(layout.blocks[0], pushed[0], results[0][0])
        assert results[0][0] == results[1][0]
    finally:
        await close(clients)


async def test_duplicate_push_is_ignored_and_retry_after_result_resends(shard: ShardServer) -> None:
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=None))
    a, b = await connect(shard, layout, 2)
    try:
        xa, xb = torch.full((4096,), 1.0), torch.full((4096,), 2.0)
        pa, pb = encode(xa, Codec.FP32).to_bytes(), encode(xb, Codec.FP32).to_bytes()
        fut = a.expect(0, 0)
        await a.push(0, 0, pa)
        await a.push(0, 0, pa)  # retry: must not count twice
        result = await b.exchange(0, 0, pb)
        assert torch.equal(dequantize(result), xa + xb)
        assert await fut == result
        # a push of the finished round again (retry after a lost reply) gets the result again
        assert await a.exchange(0, 0, pa) == result
    finally:
        await close([a, b])


async def test_missing_node_fails_the_round_for_everyone(shard: ShardServer) -> None:
    shard.service.config = dataclasses.replace(shard.config, round_timeout_s=0.5)  # (ServerConfig is frozen)
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=None))
    a, b = await connect(shard, layout, 2)
    try:
        with pytest.raises(RoundFailedError, match="waiting for node\\(s\\): node-1") as info:
            await asyncio.wait_for(a.exchange(0, 0, encode(torch.ones(4096), Codec.FP32).to_bytes()), 10)
        assert info.value.missing_nodes == ("node-1",)
        with pytest.raises(RoundFailedError, match="node-1"):  # the idle node hears it too
            await asyncio.wait_for(b.exchange(0, 0, encode(torch.ones(4096), Codec.FP32).to_bytes()), 10)
    finally:
        await close([a, b])


async def test_unregistered_nodes_are_reported_missing(shard: ShardServer) -> None:
    shard.service.config = dataclasses.replace(shard.config, round_timeout_s=0.5)  # (ServerConfig is frozen)
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=None))
    a = ShardClient(f"127.0.0.1:{shard.port}", "solo", 3, layout, security=SECURITY)
    await a.connect()
    try:
        with pytest.raises(RoundFailedError, match="2 of 3 node\\(s\\) that never registered with this shard "
                                                   "\\(registered: solo\\)"):
            await asyncio.wait_for(a.exchange(0, 0, encode(torch.ones(4096), Codec.FP32).to_bytes()), 10)
    finally:
        await a.close()


async def test_a_round_costs_one_kernel_thread_hop_its_last_push() -> None:
    """A compressed push that does not complete its round is checked and kept on the event loop;
    the push completing it is kept, summed and encoded in one hop (aggregator.py, threads.py):
    two nodes, three 4-bit rounds, three hops, and each round's result the exact sum. An FP32
    round decodes every push, so each takes its hop: two more."""
    from concurrent.futures import ThreadPoolExecutor

    from cgx_ps.server.rounds.aggregator import Aggregator

    class CountingExecutor(ThreadPoolExecutor):
        hops = 0

        def submit(self, fn, /, *args, **kwargs):
            self.hops += 1
            return super().submit(fn, *args, **kwargs)

    class Sink:
        def __init__(self) -> None:
            self.results: list[bytes] = []

        def deliver(self, block_id, round_, result, pushers) -> None:
            self.results.append(bytes(result))

        def round_failed(self, failure) -> None:
            raise AssertionError(failure)

    block = make_layout([TensorInfo("w", (64, 64))], Compression(bits=4, bucket_size=512)).blocks[0]
    with CountingExecutor(2) as executor:
        sink = Sink()
        agg = Aggregator([block], 2, executor, sink, {"n0", "n1"}, round_timeout_s=30)
        for round_ in range(3):
            pushed = [_good(block), _good(block)]
            for node, payload in zip(("n0", "n1"), pushed):
                assert (await agg.push(node, 0, block.block_id, round_, payload)).accepted
            check_aggregate(block, pushed, sink.results[-1], round_)
        assert executor.hops == 3 and len(sink.results) == 3
        xs = [torch.randn(block.numel) for _ in range(2)]
        for node, x in zip(("n0", "n1"), xs):
            assert (await agg.push(node, 0, block.block_id, 3, encode(x, Codec.FP32).to_bytes())).accepted
        assert executor.hops == 5 and dequantize(sink.results[-1]).equal(xs[0] + xs[1])
        agg.close()


async def test_uncompressed_rounds_for_compressed_blocks(shard: ShardServer, open_channel) -> None:
    """Warm-up or auto mode: a 4-bit block may travel as FP32 if every node of the round agrees."""
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=4, bucket_size=512))
    a, b = await connect(shard, layout, 2)
    try:
        xa, xb = torch.randn(4096), torch.randn(4096)
        result = await asyncio.gather(a.exchange(0, 0, encode(xa, Codec.FP32).to_bytes()),
                                      b.exchange(0, 0, encode(xb, Codec.FP32).to_bytes()))
        assert result[0] == result[1] and torch.equal(dequantize(result[0]), xa + xb)
        # the next round is compressed again: the result is 4-bit too
        blk = layout.blocks[0]
        pa, pb = encode_block(blk, xa, 1), encode_block(blk, xb, 2)
        result = await asyncio.gather(a.exchange(0, 1, pa), b.exchange(0, 1, pb))
        check_aggregate(blk, [pa, pb], result[0], round_=1)
        # mixing encodings inside one round is refused
        fut = a.expect(0, 2)
        await a.push(0, 2, encode_block(blk, xa, 3))
        channel, call = await raw_stream(open_channel, shard, "node-1", layout, b.session_id)
        p = encode(xb, Codec.FP32).to_bytes()
        await call.write(ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(round=2, block_id=0, total_bytes=len(p),
                                                                      offset=0, data=p)))
        await expect_status(call, grpc.StatusCode.INVALID_ARGUMENT, "other nodes pushed MAXMIN bits=4")
        await channel.close()
        fut.cancel()
    finally:
        await close([a, b])


async def test_set_codecs_changes_a_block_from_a_round_on(shard: ShardServer) -> None:
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=4, bucket_size=512))
    a, b = await connect(shard, layout, 2)
    two = ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=2, bucket_size=512, stochastic=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{shard.port}") as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            await stub.SetCodecs(ps_pb2.SetCodecsRequest(node_id="node-0", from_round=1, session_id=a.session_id,
                                                         blocks=[ps_pb2.BlockCodec(block_id=0, codec=two)]),
                                 metadata=METADATA)
            blk = layout.blocks[0]
            x = torch.randn(4096)
            r0 = await asyncio.gather(a.exchange(0, 0, encode_block(blk, x, 1)), b.exchange(0, 0, encode_block(blk, x, 2)))
            assert decode_header_bits(r0[0]) == 4  # round 0: still 4 bits
            p2 = encode(x, Codec.MAXMIN, bits=2, bucket_size=512, stochastic=True, seed=3).to_bytes()
            r1 = await asyncio.gather(a.exchange(0, 1, p2), b.exchange(0, 1, p2))
            assert decode_header_bits(r1[0]) == 2 and r1[0] == r1[1]
            # a change for a round already under way is refused
            fut = a.expect(0, 2)
            await a.push(0, 2, p2)
            while not shard.service.rounds_in_flight() or shard.service.pending_pushes:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SetCodecs(ps_pb2.SetCodecsRequest(node_id="node-0", from_round=2, session_id=a.session_id,
                                                             blocks=[ps_pb2.BlockCodec(block_id=0, codec=two)]),
                                     metadata=METADATA)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "round 2 is already under way" in info.value.details()
            fut.cancel()
            reply = await stub.Probe(iter([ps_pb2.ProbeChunk(data=b"x" * 1000)] * 3), metadata=METADATA)
            assert reply.bytes == 3000
        body = urllib.request.urlopen(f"http://127.0.0.1:{shard.metrics_port}/metrics", timeout=5).read().decode()
        assert 'cgx_ps_block_bits{block="0",shard="0"} 2.0' in body
    finally:
        await close([a, b])


def decode_header_bits(payload: bytes) -> int:
    from cgx_ps.kernels import decode_header
    return decode_header(payload).bits


@pytest.mark.parametrize("error_feedback", [False, True])
async def test_server_error_feedback_cancels_requantization_error(error_feedback: bool) -> None:
    server = ShardServer(ServerConfig(host="127.0.0.1", port=0, error_feedback=error_feedback))
    await server.start()
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=2, bucket_size=512, stochastic=False))
    a, b = await connect(server, layout, 2)
    try:
        blk = layout.blocks[0]
        pa, pb = encode_block(blk, torch.randn(4096), 0), encode_block(blk, torch.randn(4096), 0)
        exact = dequantize(pa) + dequantize(pb)  # the same every round: only the server's rounding errs
        results = []
        for r in range(16):
            out = await asyncio.gather(a.exchange(0, r, pa), b.exchange(0, r, pb))
            results.append(dequantize(out[0]))
        mean_error = float((torch.stack(results).mean(0) - exact).abs().mean())
        single_error = float((results[0] - exact).abs().mean())
        assert single_error > 0
        if error_feedback:
            assert mean_error < 0.25 * single_error  # the carried residual cancels over rounds
        else:
            assert mean_error == pytest.approx(single_error)  # nearest rounding: the same error each round
    finally:
        await close([a, b])
        await server.stop(drain=False)


@pytest.mark.parametrize("shard_sees_the_drop_first", [False, True])
async def test_reconnect_mid_round_gets_the_result_on_the_new_stream(shard: ShardServer,
                                                                    shard_sees_the_drop_first: bool) -> None:
    """The stream breaks after a push; the worker reconnects and re-pushes (a duplicate) and the
    result must come on the new stream, also when the shard saw the old stream end before the
    new one said Hello (no swap takes place then; this used to time out)."""
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=None))
    a, b = await connect(shard, layout, 2)
    try:
        p = encode(torch.ones(4096), Codec.FP32).to_bytes()
        await a.push(0, 0, p)
        while not shard.service.rounds_in_flight() or shard.service.pending_pushes:
            await asyncio.sleep(0.01)
        if shard_sees_the_drop_first:
            a.stream.drop()
            while ("node-0", 0) in shard.service.session.streams:
                await asyncio.sleep(0.01)
        await a.reopen()
        fut = a.expect(0, 0)
        await a.push(0, 0, p)  # re-pushed: a duplicate, but the result must come here
        result = await b.exchange(0, 0, p)
        assert await asyncio.wait_for(fut, 5) == result
    finally:
        await close([a, b])


async def test_retried_register_does_not_reset_a_running_session(shard: ShardServer) -> None:
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=None))
    a = ShardClient(f"127.0.0.1:{shard.port}", "node-0", 2, layout, security=SECURITY)
    await a.connect()  # node-0 registered and streaming: the session is running
    session = shard.service.session
    from cgx_ps.model_layout import layout_hash
    request = ps_pb2.RegisterRequest(node_id="node-1", num_nodes=2, layout=layout, layout_hash=layout_hash(layout))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shard.port}") as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        await stub.Register(request, metadata=METADATA)
        await stub.Register(request, metadata=METADATA)  # a retry (say the first reply was lost): idempotent
    b = ShardClient(f"127.0.0.1:{shard.port}", "node-1", 2, layout, security=SECURITY)
    await b.connect()
    try:
        assert shard.service.session is session
        p = encode(torch.ones(4096), Codec.FP32).to_bytes()
        results = await asyncio.gather(a.exchange(0, 0, p), b.exchange(0, 0, p))
        assert torch.equal(dequantize(results[0]), torch.full((4096,), 2.0))
    finally:
        await close([a, b])
