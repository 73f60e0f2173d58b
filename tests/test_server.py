"""Real shards on port 0, real gRPC clients: aggregation, rounds, bad input, failure, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cgx_ps.kernels import Codec, dequantize, encode
from cgx_ps.layout import codec_of
from cgx_ps.server import ServerConfig, ShardServer
from cgx_ps.server.aggregator import result_seed
from cgx_ps.server.cluster import launch_shard, wait_for_port_file
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker.client import ShardClient
from cgx_ps.worker.errors import RoundFailedError, ShardRejectedError
from cgx_ps.worker.layout import Compression, TensorInfo, build_layout
from support import METADATA, SECURITY, TOKEN_FILE, connect

TENSORS = [TensorInfo("a.weight", (300, 70)), TensorInfo("a.bias", (300,)),
           TensorInfo("b.weight", (64, 1000)), TensorInfo("c.weight", (50, 41))]
COMPRESSION = Compression(bits=4, bucket_size=512, overrides={"c.*": 2})


def make_layout(tensors=TENSORS, compression=COMPRESSION, block_bytes=64 << 10, shards=1) -> ps_pb2.Layout:
    return build_layout(tensors, shards, compression, block_bytes=block_bytes)


SHARD_SETTINGS = dict(metrics_port=0, round_timeout_s=5.0)  # the conftest `shard` fixture's


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


# ---- bad input: the bad node's stream ends with a clear status; everyone else is unharmed --------


async def raw_stream(server: ShardServer, node: str, layout: ps_pb2.Layout, session_id: str = ""):
    """An Exchange stream we drive by hand, as the member ``node`` of the session ``session_id``."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    call = ps_pb2_grpc.ParameterServerStub(channel).Exchange(metadata=METADATA)
    from cgx_ps.layout import layout_hash
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


BAD_PUSHES = {
    "garbage": (lambda blk: ps_pb2.PushChunk(round=0, block_id=blk.block_id, total_bytes=len(_good(blk)),
                                             offset=0, data=b"\x07" * len(_good(blk))),
                grpc.StatusCode.INVALID_ARGUMENT, "not a cgx-ps block"),
    "truncated": (lambda blk: ps_pb2.PushChunk(round=0, block_id=blk.block_id, total_bytes=len(_good(blk)) - 5,
                                               offset=0, data=_good(blk)[:-5]),
                  grpc.StatusCode.INVALID_ARGUMENT, "the layout says"),
    "unknown block": (lambda blk: ps_pb2.PushChunk(round=0, block_id=999, total_bytes=100, offset=0, data=b"x"),
                      grpc.StatusCode.INVALID_ARGUMENT, "block 999 is not owned"),
    "unknown codec": (lambda blk: ps_pb2.PushChunk(round=0, block_id=blk.block_id, total_bytes=len(_good(blk)),
                                                   offset=0, data=_good(blk)[:5] + b"\x09" + _good(blk)[6:]),
                      grpc.StatusCode.INVALID_ARGUMENT, "unknown codec id 9"),
    "wrong codec": (lambda blk: ps_pb2.PushChunk(
                        round=0, block_id=blk.block_id, total_bytes=len(_good(blk)), offset=0,
                        data=encode(torch.randn((len(_good(blk)) - 32) // 2), Codec.FP16).to_bytes()),
                    grpc.StatusCode.INVALID_ARGUMENT, "round 0 expects MAXMIN bits=4"),
    "gap in offsets": (lambda blk: ps_pb2.PushChunk(round=0, block_id=blk.block_id, total_bytes=len(_good(blk)),
                                                    offset=64, data=b"x" * 10),
                       grpc.StatusCode.INVALID_ARGUMENT, "does not continue"),
    "non-finite with a body": (lambda blk: ps_pb2.PushChunk(round=0, block_id=blk.block_id,
                                                           total_bytes=len(_good(blk)), offset=0,
                                                           data=_good(blk)[:7] + b"\x03" + _good(blk)[8:]),
                               grpc.StatusCode.INVALID_ARGUMENT, "payload too long"),
    "far-future round": (lambda blk: ps_pb2.PushChunk(round=7, block_id=blk.block_id, total_bytes=len(_good(blk)),
                                                      offset=0, data=_good(blk)),
                         grpc.StatusCode.FAILED_PRECONDITION, "far-future round 7"),
}


@pytest.mark.parametrize("case", sorted(BAD_PUSHES))
async def test_bad_push_rejected_and_other_nodes_unharmed(shard: ShardServer, case: str) -> None:
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=4, bucket_size=512))
    block = layout.blocks[0]
    good, bad = await connect(shard, layout, 2, prefix="n")
    make_chunk, code, match = BAD_PUSHES[case]
    chunk = make_chunk(block)
    if case == "wrong codec":  # an fp16 payload of exactly the block's wire size
        chunk.total_bytes = len(chunk.data)
        assert len(chunk.data) == len(_good(block)), "test setup: sizes must agree"
    try:
        # the good node has pushed already: its data sits in the accumulator
        xg = torch.randn(block.numel)
        pg = encode_block(block, xg, 1)
        fut = good.expect(0, 0)
        await good.push(0, 0, pg)
        channel, call = await raw_stream(shard, bad.node_id, layout, bad.session_id)
        await call.write(ps_pb2.ExchangeRequest(push=chunk))
        await expect_status(call, code, match)
        await channel.close()
        # the bad node reconnects and pushes properly: the round completes with the right sum
        await bad.reopen()
        xb = torch.randn(block.numel)
        pb = encode_block(block, xb, 2)
        result = await asyncio.wait_for(bad.exchange(0, 0, pb), 10)
        assert await fut == result
        check_aggregate(block, [pg, pb], result)
    finally:
        await close([good, bad])


async def test_nan_payload_rejected(shard: ShardServer) -> None:
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=None))
    (node,) = await connect(shard, layout, 1)
    payload = bytearray(encode(torch.ones(4096), Codec.FP32).to_bytes())
    payload[32 + 4 * 100: 32 + 4 * 101] = b"\x00\x00\xc0\x7f"  # NaN
    from cgx_ps.kernels import wire
    payload[20:24] = wire.body_crc32(payload).to_bytes(4, "little")
    channel, call = await raw_stream(shard, "node-0", layout, node.session_id)
    await call.write(ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(
        round=0, block_id=0, total_bytes=len(payload), offset=0, data=bytes(payload))))
    await expect_status(call, grpc.StatusCode.INVALID_ARGUMENT, "NaN/Inf (first at element 100)")
    await channel.close()
    await node.close()


async def test_non_finite_push_makes_the_round_non_finite_for_every_node(shard: ShardServer) -> None:
    """Mixed precision: one node's overflow (a flagged header) reaches every node as a
    non-finite result, and the next round is finite again. A flagged push with a body is
    refused like any malformed block (BAD_PUSHES: "non-finite with a body")."""
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=4, bucket_size=512))
    block = layout.blocks[0]
    a, b = await connect(shard, layout, 2, prefix="amp")
    try:
        overflow = torch.randn(block.numel)
        overflow[7] = float("inf")
        flagged = encode(overflow, Codec.MAXMIN, bits=4, bucket_size=512, allow_non_finite=True).to_bytes()
        results = await asyncio.gather(a.exchange(0, 0, flagged), b.exchange(0, 0, _good(block)))
        assert results[0] == results[1] and len(results[0]) == 32
        assert bool(dequantize(results[0]).isnan().all())
        pushed = [_good(block), _good(block)]
        results = await asyncio.gather(a.exchange(0, 1, pushed[0]), b.exchange(0, 1, pushed[1]))
        assert results[0] == results[1]
        check_aggregate(block, pushed, results[0], round_=1)
    finally:
        await close([a, b])


async def test_a_sum_that_cannot_be_encoded_fails_the_round_for_every_node(shard: ShardServer) -> None:
    """Finite pushes whose sum overflows float32: the last push is kept, summed and encoded in one
    kernel-thread hop (aggregator.py); the encoding's failure must still fail the round, loudly,
    for every node, not pass as the last push's own refusal."""
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=4, bucket_size=512))
    a, b = await connect(shard, layout, 2, prefix="huge")
    try:
        huge = encode(torch.full((4096,), 3e38), Codec.MAXMIN, bits=4, bucket_size=512).to_bytes()
        results = await asyncio.gather(a.exchange(0, 0, huge), b.exchange(0, 0, huge), return_exceptions=True)
        for got in results:
            assert isinstance(got, RoundFailedError), got
            assert "aggregate of block 0 round 0 cannot be encoded: the sum contains NaN/Inf" in str(got)
    finally:
        await close([a, b])


async def test_a_push_costs_one_kernel_thread_hop_the_rounds_last_included() -> None:
    """The push completing a round is kept, summed and encoded in its own hop (aggregator.py):
    two nodes, three rounds, six hops, and each round's result the exact sum."""
    from concurrent.futures import ThreadPoolExecutor

    from cgx_ps.server.aggregator import Aggregator

    class CountingExecutor(ThreadPoolExecutor):
        hops = 0

        def submit(self, fn, /, *args, **kwargs):
            self.hops += 1
            return super().submit(fn, *args, **kwargs)

    class Sink:
        def __init__(self) -> None:
            self.results: list[bytes] = []

        def deliver(self, block_id, round_, result, pushers) -> None:
            self.results.append(result)

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
        assert executor.hops == 6 and len(sink.results) == 3
        agg.close()


async def test_push_before_register_refused(shard: ShardServer) -> None:
    channel, call = await raw_stream(shard, "stranger", make_layout())
    await expect_status(call, grpc.StatusCode.FAILED_PRECONDITION, "has not registered")
    await channel.close()


async def test_mismatched_layout_refused_naming_the_tensor(shard: ShardServer) -> None:
    first = ShardClient(f"127.0.0.1:{shard.port}", "node-0", 2, make_layout(), security=SECURITY)
    await first.connect()
    other = [*TENSORS[:2], TensorInfo("b.weight", (64, 999)), TENSORS[3]]
    client = ShardClient(f"127.0.0.1:{shard.port}", "node-1", 2, make_layout(other), security=SECURITY)
    with pytest.raises(ShardRejectedError, match=r"tensor 'b.weight': shape \[64, 1000\] expected, got \[64, 999\]"):
        await client.connect()
    await client.close()
    await first.close()


async def test_stale_round_refused(shard: ShardServer) -> None:
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=None))
    (node,) = await connect(shard, layout, 1)
    p = encode(torch.ones(4096), Codec.FP32).to_bytes()
    for r in range(3):
        await node.exchange(0, r, p)
    await node.close()
    channel, call = await raw_stream(shard, "node-0", layout, node.session_id)
    await call.write(ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(round=0, block_id=0, total_bytes=len(p),
                                                                  offset=0, data=p)))
    await expect_status(call, grpc.StatusCode.FAILED_PRECONDITION, "stale round 0, the shard expects round 3")
    await channel.close()


async def test_backpressure_bounds_memory_without_deadlock() -> None:
    cfg = ServerConfig(host="127.0.0.1", port=0, round_timeout_s=20, max_inflight_bytes=2 << 20)
    server = ShardServer(cfg)
    await server.start()
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, server.service.budget.used)
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    layout = make_layout([TensorInfo("w", (1024, 1536))], Compression(bits=None), block_bytes=1 << 20)
    clients = await connect(server, layout, 4)
    try:
        for r in range(2):
            pushed, results = await asyncio.wait_for(run_round(clients, layout, r), 60)
            check_aggregate(layout.blocks[0], pushed[0], results[0][0], r)
        assert 0 < peak <= cfg.max_inflight_bytes
    finally:
        watcher.cancel()
        await close(clients)
        await server.stop(drain=False)


async def test_metrics_and_health(shard: ShardServer) -> None:
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=4, bucket_size=512))
    clients = await connect(shard, layout, 2)
    await run_round(clients, layout, 0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{shard.metrics_port}/metrics", timeout=5).read().decode()
    assert 'cgx_ps_rounds_total{shard="0"} 1.0' in body
    assert 'cgx_ps_pushes_total{node="node-0",outcome="accepted",shard="0"} 1.0' in body
    assert 'cgx_ps_connected_nodes{shard="0"} 2.0' in body
    ratio = [line for line in body.splitlines() if line.startswith("cgx_ps_compression_ratio{")]
    assert ratio and float(ratio[0].split()[-1]) > 6  # 4-bit: ~7x smaller than fp32
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shard.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="cgx_ps.v1.ParameterServer"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await close(clients)


async def test_drain_finishes_rounds_in_flight() -> None:
    server = ShardServer(ServerConfig(host="127.0.0.1", port=0, round_timeout_s=10, drain_timeout_s=10))
    await server.start()
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=None))
    a, b = await connect(server, layout, 2)
    p = encode(torch.ones(4096), Codec.FP32).to_bytes()
    fut = a.expect(0, 0)
    await a.push(0, 0, p)
    while not server.service.rounds_in_flight():  # the shard has seen the push
        await asyncio.sleep(0.01)
    stopping = asyncio.create_task(server.stop(drain=True))
    await asyncio.sleep(0.2)
    assert not stopping.done()  # waits for the round in flight
    result = await asyncio.wait_for(b.exchange(0, 0, p), 5)
    assert await fut == result and torch.equal(dequantize(result), torch.full((4096,), 2.0))
    await asyncio.wait_for(stopping, 10)
    await close([a, b])


def test_server_binary_health_bad_input_and_sigterm(tmp_path) -> None:
    port_file = tmp_path / "ports.json"
    proc = launch_shard(["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--drain-timeout", "5"],
                        port_file, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        try:
            port = wait_for_port_file(proc, port_file, time.monotonic() + 60)["port"]
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"shard {exc}: {proc.stdout.read()}") from None

        async def probe() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                stub = ps_pb2_grpc.ParameterServerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Register(ps_pb2.RegisterRequest(node_id="x", num_nodes=1, layout=make_layout(),
                                                               layout_hash="nope"), metadata=METADATA)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "does not match the layout" in info.value.details()

        asyncio.run(probe())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        out = proc.stdout.read()
        assert "shard=0" in out and "draining" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_uncompressed_rounds_for_compressed_blocks(shard: ShardServer) -> None:
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
        channel, call = await raw_stream(shard, "node-1", layout, b.session_id)
        p = encode(xb, Codec.FP32).to_bytes()
        await call.write(ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(round=2, block_id=0, total_bytes=len(p),
                                                                      offset=0, data=p)))
        await expect_status(call, grpc.StatusCode.INVALID_ARGUMENT, "other nodes pushed MAXMIN bits=4")
        await channel.close()
        fut.cancel()
    finally:
        await close([a, b])


async def test_blob_put_get() -> None:
    server = ShardServer(ServerConfig(host="127.0.0.1", port=0, max_inflight_bytes=4 << 20, token_file=TOKEN_FILE))
    await server.start()
    (member,) = await connect(server, make_layout(), 1)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)

            async def get(key: str, timeout: float) -> tuple[bytes, tuple[str, int]]:
                call = stub.GetBlob(ps_pb2.GetBlobRequest(key=key, timeout_s=timeout, session_id=member.session_id),
                                    metadata=METADATA)
                parts = [c async for c in call]
                return b"".join(c.data for c in parts), (parts[-1].node_id, parts[-1].member)

            def blob(key: str, data: bytes, step: int = 1 << 20) -> list[ps_pb2.BlobChunk]:
                return [ps_pb2.BlobChunk(key=key, total_bytes=len(data), offset=o, data=data[o:o + step],
                                         node_id="node-0", member=0, session_id=member.session_id)
                        for o in range(0, max(len(data), 1), step)]

            waiter = asyncio.create_task(get("params/0", 10))  # waits until put
            data = bytes(range(256)) * 10_000  # 2.5 MB: several chunks
            await stub.PutBlob(iter(blob("params/0", data)), metadata=METADATA)
            assert await waiter == (data, ("node-0", 0))  # the bytes, and who wrote them
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await get("missing", 0.2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "was not put" in info.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.PutBlob(iter(blob("params/0", b"abc")), metadata=METADATA)
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.PutBlob(iter(blob("big", b"x" * (2 << 20), step=2 << 20)), metadata=METADATA)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await member.close()
        await server.stop(drain=False)


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
            a._call.cancel()
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
    from cgx_ps.layout import layout_hash
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


async def test_budget_cancelled_waiter_lets_smaller_ones_through() -> None:
    from cgx_ps.server.budget import ByteBudget

    budget = ByteBudget(10)
    await budget.acquire(8)
    big = asyncio.create_task(budget.acquire(5))
    small = asyncio.create_task(budget.acquire(1))
    await asyncio.sleep(0.01)
    assert not small.done()  # FIFO: behind the big one
    big.cancel()
    await asyncio.wait_for(small, 1)
    assert budget.used == 9


async def test_drain_after_a_failed_round_does_not_wait_for_it() -> None:
    server = ShardServer(ServerConfig(host="127.0.0.1", port=0, round_timeout_s=0.3, drain_timeout_s=10))
    await server.start()
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=None))
    a, b = await connect(server, layout, 2)
    with pytest.raises(RoundFailedError):
        await asyncio.wait_for(a.exchange(0, 0, encode(torch.ones(4096), Codec.FP32).to_bytes()), 5)
    t0 = asyncio.get_running_loop().time()
    await server.stop(drain=True)
    assert asyncio.get_running_loop().time() - t0 < 5
    await close([a, b])
