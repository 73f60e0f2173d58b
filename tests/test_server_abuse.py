"""A hostile or buggy client against a real shard: it gets a clear error, the other nodes keep
training (or get a clear error naming the culprit within the round timeout), and the shard's
memory stays bounded. Each test is a regression test for a found bug."""

from __future__ import annotations

import asyncio
import time
import weakref

import grpc
import pytest
import torch

from cgx_ps.kernels import Codec, CodecError, dequantize, encode
from cgx_ps.kernels.wire import HEADER_SIZE, parse_header
from cgx_ps.model_layout import LayoutError, layout_hash, validate_layout
from cgx_ps.net.security import read_token
from cgx_ps.server import ShardServer
from cgx_ps.server.rpc import service as service_module
from cgx_ps.server.session.blobs import BlobUpload
from cgx_ps.server.rounds.budget import ByteBudget
from cgx_ps.net.channel_options import CHUNK_BYTES
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker.shards.client import ShardClient, read_result
from cgx_ps.worker.shards.raw_call import RawCall
from cgx_ps.worker.errors import RoundFailedError, ShardRejectedError, ShardUnavailableError, StreamEnded
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
from support import METADATA, SECURITY, TOKEN_FILE, connect, until

ROUND_TIMEOUT = 1.5
SHARD_SETTINGS = dict(round_timeout_s=ROUND_TIMEOUT, drain_timeout_s=3.0)  # conftest.start_shard


def layout_of(*shapes: tuple[int, ...], block_bytes: int = 64 << 10) -> ps_pb2.Layout:
    tensors = [TensorInfo(f"t{i}", s) for i, s in enumerate(shapes)]
    return build_layout(tensors, 1, Compression(bits=None), block_bytes=block_bytes)


def fp32(n: int, value: float = 1.0) -> bytes:
    return encode(torch.full((n,), value), Codec.FP32).to_bytes()


class _PlaneStream:
    """An Exchange stream over the shard's raw data plane, driven as ``raw_stream``'s gRPC call
    (messages in, results and the final status out) and closed as its channel."""

    def __init__(self, call: RawCall) -> None:
        self.call = call

    async def write(self, message: ps_pb2.ExchangeRequest) -> None:
        await self.call.write(message.SerializeToString())

    def __aiter__(self):
        return aiter(self.call)

    async def close(self) -> None:
        self.call.cancel()


async def raw_stream(open_channel, server: ShardServer, node: str, layout, member: int = 0, register: bool = False,
                     num_nodes: int = 2, session_id: str = "", transport: str = "grpc"):
    """An Exchange stream we drive message by message (after an optional Register, whose
    session id the Hello then carries), on a channel from the ``open_channel`` fixture;
    ``transport`` "raw": over the shard's raw data plane (the stream is then its own channel)."""
    channel = open_channel(f"127.0.0.1:{server.port}")
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    if register:
        reply = await stub.Register(ps_pb2.RegisterRequest(node_id=node, num_nodes=num_nodes, layout=layout,
                                                           layout_hash=layout_hash(layout), member=member),
                                    metadata=METADATA)
        session_id = reply.session_id
    if transport == "raw":
        await channel.close()
        channel = call = _PlaneStream(await RawCall.open("127.0.0.1", server.data_port, read_token(TOKEN_FILE).encode(),
                                                                 read_result))
    else:
        call = stub.Exchange(metadata=METADATA)
    await call.write(ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id=node, layout_hash=layout_hash(layout),
                                                               member=member, session_id=session_id)))
    return channel, call


def chunk(block_id: int, round_: int, total: int, offset: int, data: bytes) -> ps_pb2.ExchangeRequest:
    return ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(round=round_, block_id=block_id, total_bytes=total,
                                                        offset=offset, data=data))


async def final_status(call, timeout: float = 10) -> tuple[str, str]:
    async def read_all():
        try:
            async for _ in call:
                pass
            return "OK", ""
        except grpc.aio.AioRpcError as e:
            return e.code().name, e.details()
        except StreamEnded as e:  # the raw data plane's end
            return e.code, e.details
    return await asyncio.wait_for(read_all(), timeout)


async def close(server, clients, channels=()):
    for c in clients:
        await c.close()
    for ch in channels:
        await ch.close()
    await server.stop(drain=False)


# ---- headers and layouts --------------------------------------------------------------------------


@pytest.mark.parametrize("codec, bits", [(Codec.FP32, 5), (Codec.FP32, 0), (Codec.FP16, 7)])
def test_float_headers_must_carry_their_fixed_bits(codec, bits):
    payload = bytearray(encode(torch.ones(16), codec).to_bytes())
    payload[6] = bits  # the CRC covers the body only: this header still "checks out"
    with pytest.raises(CodecError, match=f"{codec.name} header must say bits="):
        parse_header(bytes(payload))


async def test_a_bad_float_header_is_refused_and_does_not_lock_out_the_good_node(start_shard):
    """Before: the bad bits were accepted and then the good node's correct push was refused."""
    layout = layout_of((64, 64))
    server = await start_shard()
    good, bad = await connect(server, layout, 2)
    payload = bytearray(fp32(4096))
    payload[6] = 5
    with pytest.raises(ShardRejectedError, match="FP32 header must say bits=32"):
        await asyncio.wait_for(bad.exchange(0, 0, bytes(payload)), 10)
    with pytest.raises(RoundFailedError, match="node-1"):  # the bad node is the one named
        await asyncio.wait_for(good.exchange(0, 0, fp32(4096)), 10)
    await close(server, [good, bad])


def test_negative_dimensions_are_refused():
    layout = layout_of((64, 64))
    layout.tensors[0].shape[:] = [-64, -64]  # the product is still 4096
    with pytest.raises(LayoutError, match="negative dimension"):
        validate_layout(layout)


async def test_overlong_ids_are_refused_at_register(start_shard):
    layout = layout_of((64, 64))
    server = await start_shard()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Register(ps_pb2.RegisterRequest(node_id="n" * 200_000, num_nodes=1, layout=layout,
                                                       layout_hash=layout_hash(layout)), metadata=METADATA)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 256 characters" in err.value.details()
    await server.stop(drain=False)


# ---- the byte budget: stalls, interleaving, cancellation --------------------------------------------


@pytest.mark.parametrize("transport", ["grpc", "raw"])  # the raw data plane's memory bound is the same
async def test_a_stalled_upload_releases_its_budget_and_the_round_fails_naming_it(start_shard, transport, open_channel):
    """Before: half a block held the budget forever; the good node's push waited on it, no
    round timer started, and everyone hung."""
    layout = layout_of((384, 1024), block_bytes=4 << 20)  # one 1.5 MiB block
    total = HEADER_SIZE + 4 * layout.blocks[0].numel
    server = await start_shard(max_inflight_bytes=2 << 20, data_port=0)
    good, _ = await connect(server, layout, 2)
    channel, call = await raw_stream(open_channel, server, "node-1", layout, member=1, register=True, transport=transport)
    await call.write(chunk(0, 0, total, 0, b"\0" * (1 << 20)))  # the first MiB, then nothing
    for _attempt in range(100):  # the shard holds the half block before the good node pushes
        if server.service.budget.used >= total:
            break
        await asyncio.sleep(0.02)
    assert server.service.budget.used >= total
    t0 = time.monotonic()
    with pytest.raises(RoundFailedError, match="node-1"):
        await asyncio.wait_for(good.exchange(0, 0, fp32(layout.blocks[0].numel)), 15)
    assert time.monotonic() - t0 < 3 * ROUND_TIMEOUT + 2
    code, details = await final_status(call)
    assert code == "DEADLINE_EXCEEDED" and f"sent {1 << 20} of {total} bytes of block 0" in details, details
    assert server.service.budget.used == 0
    await close(server, [good, _], [channel])


async def test_a_stalled_blob_upload_never_blocks_gradients(start_shard, open_channel):
    """Before: a PutBlob declaring the whole budget froze every push. (Strangers are refused
    outright now; here a member of the session stalls.)"""
    cap = 2 << 20
    server = await start_shard(max_inflight_bytes=cap)
    layout = layout_of((64, 64))
    a, b = await connect(server, layout, 2)
    channel = open_channel(f"127.0.0.1:{server.port}")
    never = asyncio.Event()

    async def stalled():
        yield ps_pb2.BlobChunk(key="evil", total_bytes=cap - 100, offset=0, data=b"x", node_id="node-1",
                               session_id=b.session_id)
        await never.wait()

    put = asyncio.ensure_future(ps_pb2_grpc.ParameterServerStub(channel).PutBlob(stalled(), metadata=METADATA))
    await until(lambda: server.service.blobs.used > 0, 10, "the stalled upload reached the shard")
    assert server.service.blobs.used == cap - 100 + len("evil")  # reserved by the upload
    results = await asyncio.wait_for(asyncio.gather(a.exchange(0, 0, fp32(4096)), b.exchange(0, 0, fp32(4096))), 10)
    assert all(torch.equal(dequantize(r), torch.full((4096,), 2.0)) for r in results)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # and the stalled put ends with a reason
        await asyncio.wait_for(put, 10)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "1 of 2097052 bytes arrived" in \
        err.value.details(), err.value.details()
    assert server.service.blobs.used == 0
    await close(server, [a, b], [channel])


async def test_interleaved_blocks_on_one_stream_are_refused_not_deadlocked(start_shard, open_channel):
    """Before: chunk 0 of block 0, then chunk 0 of block 1, with the budget full: the stream
    waited for budget while holding block 0's reservation, forever."""
    layout = layout_of((256, 1024), (256, 1024), block_bytes=1 << 20)
    assert len(layout.blocks) == 2
    total = HEADER_SIZE + 4 * layout.blocks[0].numel
    server = await start_shard(max_inflight_bytes=2 << 20)
    good, _ = await connect(server, layout, 2)
    channel, call = await raw_stream(open_channel, server, "node-1", layout, member=1, register=True)
    await call.write(chunk(0, 0, total, 0, b"\0" * (total // 2)))
    await call.write(chunk(1, 0, total, 0, b"\0" * (total // 2)))
    code, details = await final_status(call)
    assert code == "INVALID_ARGUMENT" and "must send one block's chunks contiguously" in details, details
    assert server.service.budget.used == 0 and not server.service.budget._waiters
    await close(server, [good, _], [channel])


async def test_budget_waiter_cancelled_while_released_raises_cancelled():
    budget = ByteBudget(10)
    await budget.acquire(8)
    waiter = asyncio.create_task(budget.acquire(5))
    await asyncio.sleep(0)
    waiter.cancel()
    budget.release(8)  # pops the cancelled waiter in the same loop turn
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.used == 0 and not budget._waiters


# ---- streams --------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["grpc", "raw"])  # over the raw data plane, TCP's window holds the writes
async def test_a_client_that_never_reads_its_results_is_cut_off_and_memory_stays_bounded(start_shard, transport, open_channel):
    """Before: results queued without limit for a client pushing without reading (~1 MiB a round)."""
    layout = layout_of((256, 1024), block_bytes=2 << 20)  # one 1 MiB block
    n = layout.blocks[0].numel
    payload = fp32(n)
    server = await start_shard(max_inflight_bytes=4 << 20, data_port=0)
    good, _ = await connect(server, layout, 2)
    # replaces node-1's stream; never reads
    channel, call = await raw_stream(open_channel, server, "node-1", layout, session_id=_.session_id, transport=transport)
    cap = server.service.session.result_cap
    for r in range(12):
        for off in range(0, len(payload), 1 << 20):
            await call.write(chunk(0, r, len(payload), off, payload[off:off + (1 << 20)]))
        result = await asyncio.wait_for(good.exchange(0, r, payload), 10)
        assert dequantize(result)[0].item() == 2.0  # the good node keeps training
        stream = server.service.session.streams.get(("node-1", 0))
        assert stream is None or (stream.queued_bytes <= cap and stream.queue.qsize() <= 3)
    code, details = await final_status(call, timeout=3 * ROUND_TIMEOUT + 5)
    assert code == "RESOURCE_EXHAUSTED" and "is not reading its results" in details, details  # the first cause
    assert ("node-1", 0) not in server.service.session.streams  # its handler ended, its queue freed
    await close(server, [good, _], [channel])


async def test_two_members_of_a_node_pushing_the_same_block_is_refused(start_shard):
    """Before: the second member's data was dropped as a "retry" and it waited forever."""
    layout = layout_of((64, 64))
    server = await start_shard()
    a, b = await connect(server, layout, 2)
    twin = ShardClient(f"127.0.0.1:{server.port}", "node-0", 2, layout, connect_timeout_s=5, member=1, security=SECURITY)
    await twin.connect()
    first = asyncio.ensure_future(a.exchange(0, 0, fp32(4096, 1.0)))
    await until(lambda: "node-0" in server.service.session.aggregator.pushed_nodes(), 10, "member 0's push")
    with pytest.raises(ShardRejectedError, match="already pushed by member 0 of node node-0"):
        await asyncio.wait_for(twin.exchange(0, 0, fp32(4096, 100.0)), 10)
    result, other = await asyncio.wait_for(asyncio.gather(first, b.exchange(0, 0, fp32(4096, 1.0))), 10)
    assert dequantize(result)[0].item() == 2.0 and result == other
    await close(server, [a, b, twin])


async def test_another_member_pushing_a_finished_round_is_refused_too(start_shard):
    """The round already completed (its result sent): a second member's push of the same round
    used to be taken for a retry, answered with the result and its gradient dropped."""
    layout = layout_of((64, 64))
    server = await start_shard()
    a, b = await connect(server, layout, 2)
    twin = ShardClient(f"127.0.0.1:{server.port}", "node-0", 2, layout, connect_timeout_s=5, member=1, security=SECURITY)
    await twin.connect()
    await asyncio.wait_for(asyncio.gather(a.exchange(0, 0, fp32(4096)), b.exchange(0, 0, fp32(4096))), 10)
    with pytest.raises(ShardRejectedError, match="already pushed by member 0 of node node-0"):
        await asyncio.wait_for(twin.exchange(0, 0, fp32(4096, 100.0)), 10)
    await close(server, [a, b, twin])


async def test_a_replaced_stream_is_told_why(start_shard, open_channel):
    layout = layout_of((64, 64))
    server = await start_shard()
    a, b = await connect(server, layout, 2)
    channel, call = await raw_stream(open_channel, server, "node-0", layout, session_id=a.session_id)  # a second stream for node-0 member 0
    with pytest.raises(RoundFailedError, match="replaced by a newer stream of node node-0 member 0"):
        await asyncio.wait_for(a.exchange(0, 0, fp32(4096)), 10)
    call.cancel()
    await close(server, [a, b], [channel])


async def test_results_already_due_are_delivered_while_the_shard_drains(start_shard):
    """Before: node-1's rejected new round ended its stream before the result of the round it
    had just completed was sent, so only node-0 got it (replicas diverged)."""
    layout = layout_of((64, 64), (64, 64), block_bytes=16 << 10)
    assert len(layout.blocks) == 2
    server = await start_shard(round_timeout_s=30, drain_timeout_s=4)
    a, b = await connect(server, layout, 2)
    f0 = a.expect(0, 0)
    await a.push(0, 0, fp32(4096))
    # node-0's push opened the round before the drain (a round opened during it is refused)
    await until(lambda: "node-0" in server.service.session.aggregator.pushed_nodes(), 10, "node-0's push")
    stopping = asyncio.ensure_future(server.stop(drain=True))
    await until(lambda: server.service.draining, 10, "the drain")
    g0, g1 = b.expect(0, 0), b.expect(1, 0)
    await b.push(0, 0, fp32(4096))  # completes round 0 of block 0
    try:
        await b.push(1, 0, fp32(4096))  # a new round: refused while draining
    except ShardUnavailableError:
        pass
    r0, r1 = await asyncio.wait_for(asyncio.gather(f0, g0), 10)
    assert r0 == r1 and dequantize(r0)[0].item() == 2.0
    with pytest.raises((ShardUnavailableError, RoundFailedError), match="no new rounds|shutting down"):
        await asyncio.wait_for(g1, 10)
    await stopping
    for c in (a, b):
        await c.close()


# ---- blobs ------------------------------------------------------------------------------------------


async def test_blob_chunk_errors_name_the_field(start_shard):
    server = await start_shard()
    (member,) = await connect(server, layout_of((64, 64)), 1)
    sid = member.session_id
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        cases = [
            ([ps_pb2.BlobChunk(key="o", total_bytes=3, offset=0, data=b"abcd", node_id="node-0", session_id=sid)],
             "overruns total_bytes=3"),
            ([ps_pb2.BlobChunk(key="p", total_bytes=4, offset=0, data=b"ab", node_id="node-0", session_id=sid),
              ps_pb2.BlobChunk(key="q", total_bytes=4, offset=2, data=b"cd")], "chunk names blob 'q'"),
            ([ps_pb2.BlobChunk(key="g", total_bytes=4, offset=0, data=b"ab", node_id="node-0", session_id=sid),
              ps_pb2.BlobChunk(key="g", total_bytes=4, offset=3, data=b"c")], "at offset 3, expected 2"),
        ]
        for chunks, message in cases:
            async def send(items=chunks):
                for item in items:
                    yield item
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PutBlob(send(), metadata=METADATA)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    await close(server, [member], [])


async def test_a_refused_blob_upload_reports_its_reason_to_a_client_still_writing(start_shard):
    """Before: the shard ended a refused PutBlob at once, while the client was still writing the
    blob, and grpc.aio's client then reported INTERNAL "Internal error from Core" (or failed the
    write) instead of the refusal (grpc/grpc#36066): a worker whose broadcast did not fit the blob
    store was not told why (found by benchmarks/shard_memory.py's "worst" case)."""
    server = await start_shard(max_inflight_bytes=2 << 20)
    (member,) = await connect(server, layout_of((64, 64)), 1)
    total = 4 * CHUNK_BYTES  # over the blob capacity (the in-flight cap): refused at its first chunk
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = ps_pb2_grpc.ParameterServerStub(channel).PutBlob(metadata=METADATA)
        for offset in range(0, total, CHUNK_BYTES):
            await call.write(ps_pb2.BlobChunk(key="big", total_bytes=total, offset=offset, data=bytes(CHUNK_BYTES),
                                              node_id="node-0", session_id=member.session_id))
            await asyncio.sleep(0.1)  # the shard reads the first chunk and refuses the blob meanwhile
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call, 10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    assert "exceeds the shard's blob capacity" in err.value.details()
    assert server.service.blobs.used == 0
    await close(server, [member], [])


async def test_a_refused_blob_upload_frees_its_buffer_before_the_rest_is_drained(start_shard, monkeypatch):
    """Before: the drain of a refused PutBlob ran inside the ``except`` block, so the refusal's
    traceback kept the upload (a buffer of its declared size, up to the store's capacity) alive
    for up to round_timeout_s while the store said 0 bytes were in use: N refused uploads held N
    times the capacity. Checked by reference count, while the client is still writing."""
    uploads: list[weakref.ref] = []

    class TrackedUpload(BlobUpload):
        def __post_init__(self) -> None:
            super().__post_init__()
            uploads.append(weakref.ref(self))

    monkeypatch.setattr(service_module, "BlobUpload", TrackedUpload)
    server = await start_shard(round_timeout_s=10.0)  # a drain that outlasts the checks
    (member,) = await connect(server, layout_of((64, 64)), 1)
    total = 8 << 20
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = ps_pb2_grpc.ParameterServerStub(channel).PutBlob(metadata=METADATA)
        await call.write(ps_pb2.BlobChunk(key="b", total_bytes=total, offset=0, data=b"x" * 1024,
                                          node_id="node-0", session_id=member.session_id))
        deadline = time.monotonic() + 10
        while not uploads or server.service.blobs.used == 0:  # the upload has reserved its room
            assert time.monotonic() < deadline, "the shard never started the upload"
            await asyncio.sleep(0.01)
        await call.write(ps_pb2.BlobChunk(key="b", total_bytes=total, offset=7, data=b"y"))  # refused: a gap
        while server.service.blobs.used != 0:  # refused; the shard is now draining the stream
            assert time.monotonic() < deadline, "the bad chunk was not refused"
            await asyncio.sleep(0.01)
        await call.write(ps_pb2.BlobChunk(key="z", data=b"z"))  # still writing, as a hostile client would
        await asyncio.sleep(0.1)
        assert not call.done(), "the shard should still be draining the refused stream"
        assert uploads[0]() is None, "the refused upload's buffer is still held while the stream is drained"
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call, 10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at offset 7, expected 1024" in err.value.details()
    await close(server, [member], [])


async def test_a_blob_reader_that_stops_reading_does_not_keep_the_blob_after_the_store_dropped_it(start_shard,
                                                                                               monkeypatch):
    """Before: GetBlob's writes had no deadline, so a member that asked for a blob and never read
    it kept the blob alive (up to the store's capacity each) after the store dropped it at the
    next session, outside its accounting, for as long as it stayed connected."""
    class Weakable(bytearray):  # a bytearray that can be watched with a weakref
        pass

    buffers: list[weakref.ref] = []

    class TrackedUpload(BlobUpload):
        def __post_init__(self) -> None:
            self.buffer = Weakable(self.total)
            buffers.append(weakref.ref(self.buffer))

    monkeypatch.setattr(service_module, "BlobUpload", TrackedUpload)
    server = await start_shard()
    (member,) = await connect(server, layout_of((64, 64)), 1)
    total = 8 * CHUNK_BYTES  # far more than the connection's flow-control windows
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)

        async def blob():
            for offset in range(0, total, CHUNK_BYTES):
                yield ps_pb2.BlobChunk(key="big", total_bytes=total, offset=offset, data=bytes(CHUNK_BYTES),
                                       node_id="node-0", session_id=member.session_id)
        await stub.PutBlob(blob(), metadata=METADATA)
        reader = stub.GetBlob(ps_pb2.GetBlobRequest(key="big", timeout_s=5, session_id=member.session_id),
                              metadata=METADATA)  # never read
        await asyncio.sleep(0.5)  # the shard writes until flow control holds it
        server.service.blobs.clear()  # what a new session does
        deadline = time.monotonic() + ROUND_TIMEOUT + 5
        while buffers[0]() is not None:
            assert time.monotonic() < deadline, "the blob is still held by a reader that does not read"
            await asyncio.sleep(0.05)
        reader.cancel()
    await close(server, [member], [])


async def test_getblob_of_missing_keys_leaves_nothing_behind(start_shard):
    server = await start_shard()
    (member,) = await connect(server, layout_of((64, 64)), 1)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        for i in range(50):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.GetBlob(ps_pb2.GetBlobRequest(key=f"missing-{i}", timeout_s=0.01,
                                                                  session_id=member.session_id), metadata=METADATA):
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not server.service.blobs._ready and not server.service.blobs._waiting
    await close(server, [member], [])


async def test_a_member_whose_session_was_replaced_is_told_so(start_shard, open_channel):
    """Job J registered but had not opened its streams when job K took the idle shard: J's Hello
    used to hear "has not registered (push before Register)"."""
    layout = layout_of((64, 64))
    server = await start_shard()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        for node in ("node-0", "node-1"):
            reply = await stub.Register(ps_pb2.RegisterRequest(node_id=node, num_nodes=2, layout=layout,
                                                               layout_hash=layout_hash(layout), job_id="J"),
                                        metadata=METADATA)
        other = layout_of((8, 8))
        await stub.Register(ps_pb2.RegisterRequest(node_id="k-0", num_nodes=1, layout=other,
                                                   layout_hash=layout_hash(other), job_id="K"), metadata=METADATA)
    channel, call = await raw_stream(open_channel, server, "node-0", layout, session_id=reply.session_id)
    code, details = await final_status(call)
    assert code == "FAILED_PRECONDITION" and "its session ended (job 'K' replaces finished job 'J')" in details
    await close(server, [], [channel])


async def test_keepalive_pings_of_an_idle_worker_do_not_get_it_dropped(start_shard, open_channel):
    """Workers ping every 30 s even with nothing to send (evaluation, checkpointing). gRPC's server
    default answered a few such pings with GOAWAY too_many_pings, dropping workers idle ~95 s.
    Here a client pings every second for 6 s of idling, then trains on."""
    layout = layout_of((64, 64))
    server = await start_shard()
    options = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 5000),
               ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 1)]
    channel = open_channel(f"127.0.0.1:{server.port}", options)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    reply = await stub.Register(ps_pb2.RegisterRequest(node_id="node-0", num_nodes=1, layout=layout,
                                                       layout_hash=layout_hash(layout)), metadata=METADATA)
    call = stub.Exchange(metadata=METADATA)
    await call.write(ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id="node-0", layout_hash=layout_hash(layout),
                                                               session_id=reply.session_id)))
    await asyncio.sleep(6)  # idle: only pings go over the connection
    payload = fp32(4096)
    await call.write(chunk(0, 0, len(payload), 0, payload))
    response = await asyncio.wait_for(call.read(), 10)
    assert response.WhichOneof("kind") == "pull" and response.pull.total_bytes == len(payload)
    call.cancel()
    await channel.close()
    await server.stop(drain=False)
