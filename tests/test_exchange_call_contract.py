"""The contract every ExchangeCall keeps (worker/shards/exchange_call.py), one suite run against each
data plane, as PyTorch's rendezvous backends share one (``RendezvousBackendTestMixin``): a mixin of
tests with an abstract factory, one concrete class per plane, each against a real in-process shard
serving both planes. What the supervisor decides from (recovery.py) must not depend on the plane:
the same push gives the same result, and the stream ends with the same StreamEnded code."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cgx_ps.net.security import read_token
from cgx_ps.server import ShardServer
from cgx_ps.v1 import ps_pb2
from cgx_ps.worker.errors import StreamEnded
from cgx_ps.worker.shards.connection import ShardConnection
from cgx_ps.worker.shards.exchange_call import ExchangeCall, GrpcExchangeCall, read_result
from cgx_ps.worker.shards.exchange_stream import push_frames
from cgx_ps.worker.shards.raw_call import RawCall
from rounds import check_aggregate, encode_block, make_layout
from support import SECURITY, TOKEN_FILE

SHARD_SETTINGS = dict(round_timeout_s=10.0, data_port=0)  # the raw data plane on a free port
LAYOUT = make_layout()
TOKEN = read_token(TOKEN_FILE).encode()
BLOCK = LAYOUT.blocks[0]


async def _member(shard: ShardServer) -> ShardConnection:
    """The one node of a one-node session on ``shard``, registered."""
    connection = ShardConnection(f"127.0.0.1:{shard.port}", "node-0", 1, LAYOUT, connect_timeout_s=5,
                                 security=SECURITY)
    await connection.join()
    return connection


async def _result(call: ExchangeCall) -> bytes:
    """The next result the call yields, its chunks joined."""
    parts: list[bytes] = []
    async for response in call:
        assert not isinstance(response, ps_pb2.ExchangeResponse), response  # a RoundError
        parts.append(bytes(response.data))
        if response.offset + len(response.data) >= response.total_bytes:
            return b"".join(parts)
    raise AssertionError("the stream ended without a result")


async def _end(call: ExchangeCall) -> StreamEnded:
    """How the call ends, read to its end."""
    with pytest.raises(StreamEnded) as ended:
        await asyncio.wait_for(_result(call), 10)
    return ended.value


class ExchangeCallContract:
    """The tests; a subclass says which plane by ``open_call``."""

    plane = ""

    async def open_call(self, connection: ShardConnection) -> ExchangeCall:
        """A new Exchange stream to the shard of the registered ``connection``, on this plane."""
        raise NotImplementedError

    @pytest.fixture
    async def member(self, shard: ShardServer):
        connection = await _member(shard)
        yield connection
        await connection.close()

    async def test_carries_a_push_and_its_result(self, member: ShardConnection) -> None:
        call = await self.open_call(member)
        assert call.plane == self.plane
        try:
            await call.write(member.hello())
            payload = encode_block(BLOCK, torch.randn(BLOCK.numel, generator=torch.Generator().manual_seed(1)), 1)
            for frame in push_frames(BLOCK.block_id, 0, payload):
                await call.write(frame)
            result = await asyncio.wait_for(_result(call), 10)
        finally:
            call.cancel()
        check_aggregate(BLOCK, [payload], result)  # the shard's sum of the one node's push

    async def test_ends_with_the_shards_code_and_details_when_the_shard_refuses(self, member) -> None:
        call = await self.open_call(member)
        try:
            await call.write(ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(
                node_id=member.node_id, layout_hash=member.layout_hash, session_id="0" * 32)).SerializeToString())
            ended = await _end(call)
            assert (ended.code, ended.details) == ("FAILED_PRECONDITION", _NOT_A_MEMBER), ended
            with pytest.raises(StreamEnded) as refused:  # a write after the end is no silent loss
                await call.write(member.hello())
            assert refused.value.code in ("FAILED_PRECONDITION", "UNAVAILABLE"), refused.value
        finally:
            call.cancel()

    async def test_ends_unavailable_when_the_connection_breaks(self, shard: ShardServer, member) -> None:
        call = await self.open_call(member)
        try:
            await call.write(member.hello())
            reading = asyncio.create_task(_end(call))
            await asyncio.sleep(0.2)  # the read is pending
            assert not reading.done()
            await shard.stop(drain=False)
            ended = await asyncio.wait_for(reading, 10)
            assert ended.code == "UNAVAILABLE", ended
        finally:
            call.cancel()

    async def test_cancel_fails_a_pending_read_and_every_later_write_at_once(self, member) -> None:
        call = await self.open_call(member)
        await call.write(member.hello())
        reading = asyncio.create_task(_end(call))
        await asyncio.sleep(0.2)
        assert not reading.done()  # nothing comes: the read waits
        call.cancel()
        ended = await asyncio.wait_for(reading, 1.0)
        assert ended.code == "CANCELLED", ended
        with pytest.raises(StreamEnded) as refused:
            await call.write(member.hello())
        assert refused.value.code == "CANCELLED", refused.value

    async def test_a_reader_cancelled_with_the_call_stays_cancelled(self, member) -> None:
        """A task cancelled while it reads stays cancelled, also when the call is cancelled with it
        (a dropped stream: its reader must end, not take it for the stream's end and act on it)."""
        call = await self.open_call(member)
        await call.write(member.hello())
        reading = asyncio.create_task(_result(call))
        await asyncio.sleep(0.2)
        reading.cancel()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(reading, 1.0)


_NOT_A_MEMBER = "node 'node-0' has not registered with this shard (push before Register)"  # a wrong session id


class TestGrpcExchangeCall(ExchangeCallContract):
    plane = "grpc"

    async def open_call(self, connection: ShardConnection) -> ExchangeCall:
        return GrpcExchangeCall(connection.channel, connection.metadata)


class TestRawCall(ExchangeCallContract):
    plane = "raw"

    async def open_call(self, connection: ShardConnection) -> ExchangeCall:
        return await RawCall.open("127.0.0.1", connection.registration.data_port, TOKEN, read_result)


@pytest.mark.parametrize("dataplane", ["grpc", "raw"])
async def test_open_exchange_takes_the_plane_the_registration_decided(shard: ShardServer, dataplane: str) -> None:
    connection = ShardConnection(f"127.0.0.1:{shard.port}", "node-0", 1, LAYOUT, connect_timeout_s=5,
                                 security=SECURITY, dataplane=dataplane)
    await connection.join()
    call = await connection.open_exchange()
    try:
        assert call.plane == dataplane
    finally:
        call.cancel()
        await connection.close()
