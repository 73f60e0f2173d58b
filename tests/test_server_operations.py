"""Real shards on port 0, real gRPC clients: what a shard does besides rounds. Backpressure bounds
its memory, metrics and health, blobs, draining (also after a failed round), and the server
binary with bad input and SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cgx_ps.kernels import Codec, dequantize, encode
from cgx_ps.server import ServerConfig, ShardServer
from cgx_ps.server.cluster import launch_shard, wait_for_port_file
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker.shards.client import ShardClient
from cgx_ps.worker.errors import RoundFailedError
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo
from rounds import check_aggregate, close, make_layout, run_round
from support import METADATA, SECURITY, TOKEN_FILE, connect

SHARD_SETTINGS = dict(metrics_port=0, round_timeout_s=5.0)  # the conftest `shard` fixture's


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


async def test_budget_cancelled_waiter_lets_smaller_ones_through() -> None:
    from cgx_ps.server.rounds.budget import ByteBudget

    budget = ByteBudget(10)
    await budget.acquire(8)
    big = asyncio.create_task(budget.acquire(5))
    small = asyncio.create_task(budget.acquire(1))
    await asyncio.sleep(0.01)
    assert not small.done()  # FIFO: behind the big one
    assert not budget.try_acquire(1) and budget.used == 8  # nor does a push's fast path jump the queue
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


def test_a_shard_process_sums_and_re_encodes_without_loading_torch(tmp_path) -> None:
    """A shard never imports torch (kernels/encoding.py): its ~190 MiB and its second of start-up are
    a worker's business. Rounds through a real ``cgx-ps server`` process, with server-side error
    feedback and a float block, give the right aggregates, and torch's library is not mapped."""
    port_file = tmp_path / "ports.json"
    proc = launch_shard(["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--token-file", TOKEN_FILE,
                         "--error-feedback"], port_file, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        try:
            port = wait_for_port_file(proc, port_file, time.monotonic() + 60)["port"]
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"shard {exc}: {proc.stdout.read()}") from None
        layout = make_layout()
        assert {b.codec.codec for b in layout.blocks} == {ps_pb2.CODEC_FP32, ps_pb2.CODEC_MAXMIN}

        async def rounds() -> None:
            clients = [ShardClient(f"127.0.0.1:{port}", f"node-{i}", 2, layout, connect_timeout_s=10,
                                   security=SECURITY) for i in range(2)]
            try:
                for c in clients:
                    await c.connect()
                for round_ in range(3):
                    pushed, results = await asyncio.wait_for(run_round(clients, layout, round_), 60)
                    for block in layout.blocks:
                        assert results[0][block.block_id] == results[1][block.block_id]
                        if round_ == 0:  # later rounds add the shard's residual to the sum
                            check_aggregate(block, pushed[block.block_id], results[0][block.block_id], round_)
            finally:
                await close(clients)

        asyncio.run(rounds())
        maps = open(f"/proc/{proc.pid}/maps").read()
        assert "libtorch" not in maps and "numba" in maps, "the shard process loaded torch (or no kernels)"
    finally:
        proc.kill()
        proc.wait()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize("host", ["::1", "[::1]", "::"])
async def test_an_ipv6_host_serves_every_listener_and_workers_reach_it_on_both_planes(start_shard, host) -> None:
    """--host takes an IPv6 address with or without brackets, for every listener the shard opens:
    gRPC wants "[::1]:port", Python's HTTP server (metrics) and asyncio (the data plane) "::1"
    ("::1" was once refused as "port in use", and "[::1]" failed metrics and --data-port)."""
    shard = await start_shard(host=host, metrics_port=0, health_port=0, data_port=0)
    body = urllib.request.urlopen(f"http://[::1]:{shard.metrics_port}/metrics", timeout=5).read().decode()
    assert 'cgx_ps_connected_nodes{shard="0"} 0.0' in body
    async with grpc.aio.insecure_channel(f"[::1]:{shard.health_port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=4, bucket_size=512))
    # node-0 on the raw data plane, node-1 on gRPC: both reach "[::1]:port"
    clients = [ShardClient(f"[::1]:{shard.port}", f"node-{i}", 2, layout, connect_timeout_s=5, security=SECURITY,
                           dataplane=plane) for i, plane in enumerate(("raw", "grpc"))]
    try:
        for c in clients:
            await c.connect()
        pushed, results = await asyncio.wait_for(run_round(clients, layout, 0), 30)
        check_aggregate(layout.blocks[0], pushed[0], results[0][0], 0)
        assert len(shard.dataplane.connections) == 1  # node-0's stream went over the data plane
    finally:
        await close(clients)
