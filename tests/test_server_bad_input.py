"""Real shards on port 0, real gRPC clients: bad input. The bad node's stream ends with a clear
status; everyone else is unharmed."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import weakref

import grpc
import pytest
import torch

from cgx_ps.kernels import Codec, dequantize, encode
from cgx_ps.model_layout import layout_hash
from cgx_ps.server import ShardServer
from cgx_ps.server.rpc import push_frames as frames, service
from cgx_ps.net.channel_options import CHUNK_BYTES
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker.shards.client import ShardClient
from cgx_ps.worker.errors import RoundFailedError, ShardRejectedError
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo
from rounds import TENSORS, _good, check_aggregate, close, encode_block, expect_status, make_layout, raw_stream
from support import METADATA, SECURITY, connect

SHARD_SETTINGS = dict(metrics_port=0, round_timeout_s=5.0)  # the conftest `shard` fixture's


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
async def test_bad_push_rejected_and_other_nodes_unharmed(shard: ShardServer, case: str, open_channel) -> None:
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
        channel, call = await raw_stream(open_channel, shard, bad.node_id, layout, bad.session_id)
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


async def test_nan_payload_rejected(shard: ShardServer, open_channel) -> None:
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=None))
    (node,) = await connect(shard, layout, 1)
    payload = bytearray(encode(torch.ones(4096), Codec.FP32).to_bytes())
    payload[32 + 4 * 100: 32 + 4 * 101] = b"\x00\x00\xc0\x7f"  # NaN
    from cgx_ps.kernels import wire
    payload[20:24] = wire.body_crc32(payload).to_bytes(4, "little")
    channel, call = await raw_stream(open_channel, shard, "node-0", layout, node.session_id)
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


async def test_a_failure_while_summing_a_round_fails_it_for_every_node_naming_the_error(shard: ShardServer,
                                                                                        monkeypatch) -> None:
    """Memory exhausted (or a bug) while the push completing a round is summed: that push is
    already counted in the sum, so the round must fail for every node, naming the error. Before,
    only the pushing node's stream ended (INTERNAL, with a traceback in the log), the other nodes
    waited for the round timeout, and the same push sent again was summed twice: a wrong result
    for every node, without a word."""
    from cgx_ps.kernels import EncodedSum

    encode = EncodedSum.encode
    failures = iter([MemoryError("injected: the shard is out of memory")])

    def encode_failing_once(self, *args, **kwargs):
        # the test's block only: the shard's background kernel warm-up encodes a sum of its own
        failure = next(failures, None) if self.numel == 64 * 64 else None
        if failure is not None:
            raise failure
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(EncodedSum, "encode", encode_failing_once)
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=4, bucket_size=512))
    a, b = await connect(shard, layout, 2, prefix="oom")
    try:
        pushed = [_good(layout.blocks[0]) for _ in range(2)]
        results = await asyncio.wait_for(asyncio.gather(a.exchange(0, 0, pushed[0]), b.exchange(0, 0, pushed[1]),
                                                        return_exceptions=True), 4)  # the round timeout is 5 s
        for got in results:
            assert isinstance(got, RoundFailedError), got
            assert "aggregate of block 0 round 0 cannot be encoded: MemoryError: injected" in str(got), got
    finally:
        await close([a, b])


async def test_push_before_register_refused(shard: ShardServer, open_channel) -> None:
    channel, call = await raw_stream(open_channel, shard, "stranger", make_layout())
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


async def test_stale_round_refused(shard: ShardServer, open_channel) -> None:
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=None))
    (node,) = await connect(shard, layout, 1)
    p = encode(torch.ones(4096), Codec.FP32).to_bytes()
    for r in range(3):
        await node.exchange(0, r, p)
    await node.close()
    channel, call = await raw_stream(open_channel, shard, "node-0", layout, node.session_id)
    await call.write(ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(round=0, block_id=0, total_bytes=len(p),
                                                                  offset=0, data=p)))
    await expect_status(call, grpc.StatusCode.FAILED_PRECONDITION, "stale round 0, the shard expects round 3")
    await channel.close()


async def test_a_refused_push_into_a_resumed_session_changes_no_blocks_round(shard: ShardServer, open_channel) -> None:
    """A resumed session's block (the shard restarted under the job) takes its round from the
    first push it gets. Before, it took it from the first push it *saw*: a malformed push, or a
    hostile round id, set the round every other node was then refused against ("stale round"),
    and a round id near 2**64 broke every later Register (its next_rounds overflowed uint64)."""
    layout = make_layout([TensorInfo("w", (64, 64))], Compression(bits=4, bucket_size=512))
    block, job = layout.blocks[0], "resumed-after-restart"
    channel = open_channel(f"127.0.0.1:{shard.port}")
    stub = ps_pb2_grpc.ParameterServerStub(channel)

    def register(node: str, member: int = 0) -> ps_pb2.RegisterRequest:
        return ps_pb2.RegisterRequest(node_id=node, num_nodes=2, layout=layout, layout_hash=layout_hash(layout),
                                      job_id=job, member=member, resume=True)

    await stub.Register(register("good"), metadata=METADATA, timeout=5)  # a recovering node: a resumed session
    good, bad = (ShardClient(f"127.0.0.1:{shard.port}", node, 2, layout, connect_timeout_s=5, job_id=job,
                             security=SECURITY) for node in ("good", "bad"))
    try:
        for client in (good, bad):
            await client.connect()
        valid = _good(block)
        corrupt = bytearray(valid)
        corrupt[-1] ^= 0xFF
        refusals = [(5000, bytes(corrupt), False, grpc.StatusCode.INVALID_ARGUMENT, "payload corrupted"),
                    ((1 << 64) - 1, valid, False, grpc.StatusCode.INVALID_ARGUMENT, "cannot take round"),
                    ((1 << 64) - 1, valid, True, grpc.StatusCode.INVALID_ARGUMENT, "cannot take round")]
        for round_, data, restore, code, match in refusals:
            for attempt in range(5):
                raw, call = await raw_stream(open_channel, shard, "bad", layout, bad.session_id)
                try:
                    await call.write(ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(
                        round=round_, block_id=block.block_id, total_bytes=len(data), offset=0, data=data,
                        restore=restore)))
                    await expect_status(call, code, match)
                    break
                except AssertionError as exc:  # `bad`'s own stream reconnected and took the node back first
                    if "replaced by a newer stream" not in str(exc) or attempt == 4:
                        raise
                finally:
                    await raw.close()
        await bad.reopen()
        pushed = [encode_block(block, torch.randn(block.numel), seed) for seed in (1, 2)]
        results = await asyncio.wait_for(asyncio.gather(good.exchange(0, 5, pushed[0]), bad.exchange(0, 5, pushed[1])),
                                         10)
        assert results[0] == results[1]
        check_aggregate(block, pushed, results[0], round_=5)
        # a Register still answers, with the round after the one summed
        reply = await stub.Register(register("good", member=1), metadata=METADATA, timeout=5)
        assert list(reply.next_rounds) == [6]
    finally:
        await close([good, bad])
        await channel.close()


async def test_a_pushed_block_is_let_go_once_summed_not_when_its_stream_sends_again(shard: ShardServer,
                                                                                   monkeypatch) -> None:
    """The shard gives a push's bytes back to its budget once the push is summed; the stream
    reading it must not hold them beyond that. Before, the reading loop kept the last message
    and block it read until the stream's next message: on an idle stream (a step's last block,
    for the whole next backward) up to a block and a message outside the budget, per stream."""
    read: list[weakref.ref] = []

    class Watched(bytearray):  # bytes and memoryviews cannot be watched by a weakref
        pass

    def read_push(raw: bytes) -> frames.PushFrame:  # the shard's own, its data in an object a weakref can watch
        frame = frames.read_push(raw)
        data = Watched(frame.data)
        read.append(weakref.ref(data))
        return dataclasses.replace(frame, data=data)

    monkeypatch.setattr(service, "read_push", read_push)
    layout = make_layout([TensorInfo("v", (300, 1000)), TensorInfo("w", (64, 64))], Compression(bits=None),
                         block_bytes=4 * 300 * 1000)  # fp32: a push of one chunk (a view), one of two (a bytearray)
    chunks = [-(-(32 + 4 * b.numel) // CHUNK_BYTES) for b in layout.blocks]
    assert sorted(chunks) == [1, 2], chunks
    clients = await connect(shard, layout, 2, prefix="idle")
    try:
        for round_ in range(2):
            await asyncio.wait_for(asyncio.gather(*[
                c.exchange(b.block_id, round_, encode_block(b, torch.randn(b.numel), 0))
                for c in clients for b in layout.blocks]), 10)
        gc.collect()
        held = sum(ref() is not None for ref in read)
        assert len(read) == 2 * len(clients) * sum(chunks) and held == 0, f"{held} of {len(read)} chunks still held"
    finally:
        await close(clients)
