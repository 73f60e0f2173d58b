"""The raw-bytes reading of chunks (cgx_ps/net/chunk_frames.py: the shard's of pushes, server/rpc/push_frames.py;
the worker's of results, worker/shards/client.py) and both ends' framing of them (the shard's results,
the worker's pushes) must agree with protobuf on every input: what the fast path accepts,
protobuf reads the same way, and what they frame, protobuf would have written byte for byte."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgx_ps.net import chunk_frames as chunkframes
from cgx_ps.server.rpc import push_frames as frames
from cgx_ps.server.errors import BadRequest
from cgx_ps.net.channel_options import CHUNK_BYTES
from cgx_ps.v1 import ps_pb2
from cgx_ps.worker import CgxPsError
from cgx_ps.worker.shards.client import ShardClient, read_result

u64 = st.integers(0, (1 << 64) - 1)
u32 = st.integers(0, (1 << 32) - 1)
pushes = st.builds(ps_pb2.PushChunk, round=u64, block_id=u32, total_bytes=u64, offset=u64,
                   data=st.binary(max_size=300), restore=st.booleans())


def fields(chunk) -> tuple:
    return chunk.round, chunk.block_id, chunk.total_bytes, chunk.offset, bytes(chunk.data), chunk.restore


@settings(max_examples=200, deadline=None)
@given(pushes)
def test_a_push_as_clients_send_it_takes_the_fast_path_and_reads_as_protobuf_reads_it(chunk) -> None:
    raw = ps_pb2.ExchangeRequest(push=chunk).SerializeToString()
    frame = frames._fast_push(raw)
    assert frame is not None
    assert fields(frame) == fields(chunk)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pushes, st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=4),
       st.integers(0, 400), st.binary(max_size=12))
def test_on_any_bytes_the_fast_path_agrees_with_protobuf_or_leaves_them_to_it(chunk, edits, cut, extra) -> None:
    raw = bytearray(ps_pb2.ExchangeRequest(push=chunk).SerializeToString())
    for at, value in edits:  # flipped bytes, a cut-off end, trailing garbage
        if raw:
            raw[at % len(raw)] = value
    raw = bytes(raw[:cut] if cut < len(raw) else raw) + extra
    frame = frames._fast_push(raw)
    try:
        parsed = ps_pb2.ExchangeRequest.FromString(raw)
    except Exception:  # noqa: BLE001 - any protobuf refusal: the fast path must not accept it
        assert frame is None
        with pytest.raises(BadRequest):
            frames.read_push(raw)
        return
    if frame is not None:
        assert parsed.WhichOneof("kind") == "push"
        assert fields(frame) == fields(parsed.push)
    if parsed.WhichOneof("kind") == "push":
        assert fields(frames.read_push(raw)) == fields(parsed.push)
    else:
        with pytest.raises(BadRequest, match="expected a PushChunk"):
            frames.read_push(raw)


def test_a_hello_or_an_empty_message_is_not_a_push() -> None:
    hello = ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id="n")).SerializeToString()
    for raw in (hello, b""):
        with pytest.raises(BadRequest, match="expected a PushChunk"):
            frames.read_push(raw)


@settings(max_examples=30, deadline=None)
@given(u64, u32, st.sampled_from([0, 1, 1000, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 2 * CHUNK_BYTES + 5]))
def test_result_frames_are_the_bytes_protobuf_would_write(round_, block_id, size) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    got = frames.result_frames(block_id, round_, data)
    want = [ps_pb2.ExchangeResponse(pull=ps_pb2.PullChunk(round=round_, block_id=block_id, total_bytes=size,
                                                          offset=off, data=data[off:off + CHUNK_BYTES]))
            .SerializeToString() for off in range(0, max(size, 1), CHUNK_BYTES)]
    assert got == want
    # framed where the sum is encoded (a kernel thread: from the numpy encode buffer, which is
    # then reused): the same bytes, kept when that buffer changes, and its payload read back
    buffer = np.frombuffer(data, dtype=np.uint8).copy()
    framed = frames.ResultFrames.of(block_id, round_, memoryview(buffer))
    buffer[:] = 7
    assert list(framed.frames) == want and len(framed) == size and bytes(framed) == data
    if len(want) == 1:  # the payload is a view into the one frame, not a second copy
        assert framed.payload.obj is framed.frames[0]


@settings(max_examples=60, deadline=None)
@given(u64, u32, st.booleans(),
       st.sampled_from([0, 1, 1000, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 2 * CHUNK_BYTES + 5]))
def test_push_frames_are_the_bytes_protobuf_would_write(round_, block_id, restore, size) -> None:
    # the worker's pushes (net/chunk_frames.py, client.py): what the shard's fast path and protobuf read
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    got = chunkframes.chunk_frames(chunkframes.PUSH_FIELD, block_id, round_, data, restore)
    want = [ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(round=round_, block_id=block_id, total_bytes=size,
                                                         offset=off, data=data[off:off + CHUNK_BYTES],
                                                         restore=restore))
            .SerializeToString() for off in range(0, max(size, 1), CHUNK_BYTES)]
    assert got == want
    if not restore:  # framed where the payload is made (a worker's codec thread: its numpy encode buffer)
        framed = chunkframes.PushFrames.of(block_id, round_, memoryview(np.frombuffer(data, dtype=np.uint8)))
        assert list(framed.frames) == want and bytes(framed) == data and len(framed) == size


def test_a_client_refuses_frames_made_for_another_block_or_round() -> None:
    """Frames name their block and round: pushed under another key, the shard would count them
    for the block they name while the client waited for another."""
    client = ShardClient("127.0.0.1:9", "node-0", 1, ps_pb2.Layout())
    for block_id, round_ in ((1, 2), (0, 3)):
        with pytest.raises(CgxPsError, match="frames of block 0 round 2 pushed as block"):
            asyncio.run(client.push(block_id, round_, chunkframes.PushFrames.of(0, 2, b"payload")))
        with pytest.raises(CgxPsError, match="frames of block 0 round 2 pushed as block"):
            asyncio.run(client.exchange(block_id, round_, chunkframes.PushFrames.of(0, 2, b"payload")))
    assert not client.stream._unanswered  # refused before it was kept for a re-push
    assert not client.stream._waiting  # nor is a result awaited for it (it would fail unheard with the connection)


pulls = st.builds(ps_pb2.PullChunk, round=u64, block_id=u32, total_bytes=u64, offset=u64, data=st.binary(max_size=300))


def pull_fields(chunk) -> tuple:
    return chunk.round, chunk.block_id, chunk.total_bytes, chunk.offset, bytes(chunk.data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pulls, st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=4),
       st.integers(0, 400), st.binary(max_size=12))
def test_a_worker_reads_any_result_bytes_as_protobuf_does(chunk, edits, cut, extra) -> None:
    """Results as the shard sends them take the fast path; edited ones (a field 6, which a
    PullChunk lacks, a RoundError, garbage) read as protobuf reads them, or fail as it fails."""
    raw = bytearray(ps_pb2.ExchangeResponse(pull=chunk).SerializeToString())
    sent = bytes(raw)
    for at, value in edits:
        if raw:
            raw[at % len(raw)] = value
    raw = bytes(raw[:cut] if cut < len(raw) else raw) + extra
    assert pull_fields(chunkframes.read_chunk(sent, chunkframes.PULL_FIELD)) == pull_fields(chunk)
    frame = chunkframes.read_chunk(raw, chunkframes.PULL_FIELD)
    try:
        parsed = ps_pb2.ExchangeResponse.FromString(raw)
    except Exception:  # noqa: BLE001 - any protobuf refusal: the fast path must not accept it
        assert frame is None
        with pytest.raises(Exception):  # noqa: B017 - the stub's deserializer raised protobuf's error too
            read_result(raw)
        return
    result = read_result(raw)
    if frame is not None:
        assert parsed.WhichOneof("kind") == "pull" and not frame.restore
        assert pull_fields(frame) == pull_fields(result) == pull_fields(parsed.pull)
    else:
        assert result == parsed


def test_a_round_error_reaches_the_worker_as_protobuf_reads_it() -> None:
    error = ps_pb2.ExchangeResponse(error=ps_pb2.RoundError(message="gone", missing_nodes=["n1"]))
    assert read_result(error.SerializeToString()) == error
