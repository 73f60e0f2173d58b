"""SetCodecs calls: valid changes, bad rounds and settings, odd or many blocks, many future
changes."""

from __future__ import annotations

import random

from cgx_ps.v1 import ps_pb2

from ..values import U32, U64
from ..world import Identity, Plan
from .registry import scenario

def codecs_request(who: Identity, from_round: int, blocks: list[ps_pb2.BlockCodec]) -> bytes:
    return ps_pb2.SetCodecsRequest(node_id=who.node, from_round=from_round, blocks=blocks,
                                   session_id=who.session_id).SerializeToString()


def valid_settings(rng: random.Random) -> ps_pb2.CodecSettings:
    codec = rng.choice((ps_pb2.CODEC_FP32, ps_pb2.CODEC_FP16, ps_pb2.CODEC_BF16, ps_pb2.CODEC_MAXMIN))
    if codec != ps_pb2.CODEC_MAXMIN:
        return ps_pb2.CodecSettings(codec=codec)
    return ps_pb2.CodecSettings(codec=codec, bits=rng.randint(1, 8), bucket_size=8 * rng.randint(1, 128),
                                stochastic=rng.random() < 0.5)


@scenario("SetCodecs")
def setcodecs_valid(rng, w, who):
    block = w.block(rng)
    start = who.next_rounds.get(block.block_id, 0) + rng.randint(1, 3)
    return Plan([codecs_request(who, start, [ps_pb2.BlockCodec(block_id=block.block_id, codec=valid_settings(rng))])])


@scenario("SetCodecs")
def setcodecs_bad_rounds(rng, w, who):
    block = w.block(rng)
    start = rng.choice((0, max(who.next_rounds.get(block.block_id, 0) - 1, 0), U64))
    return Plan([codecs_request(who, start, [ps_pb2.BlockCodec(block_id=block.block_id, codec=valid_settings(rng))])])


@scenario("SetCodecs")
def setcodecs_bad_settings(rng, w, who):
    settings = rng.choice([
        ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=rng.choice((0, 9, 255, U32)), bucket_size=512),
        ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=4, bucket_size=rng.choice((0, 7, 12, (1 << 24) + 8, U32))),
        ps_pb2.CodecSettings(codec=rng.choice((0, 5, 99, (1 << 31) - 1, -1))),
    ])
    block = w.block(rng)
    return Plan([codecs_request(who, who.next_rounds.get(block.block_id, 0) + 1,
                                [ps_pb2.BlockCodec(block_id=block.block_id, codec=settings)])])


@scenario("SetCodecs")
def setcodecs_odd_blocks(rng, w, who):
    """Unknown block ids, duplicates, or many changes in one request (generated messages send
    up to 300,000: each costs the shard's event loop ~20 us, see test_fuzz.py)."""
    count = rng.choice((2, 50, 20_000))
    ids = [rng.choice((0, 1, len(w.blocks), U32)) for _ in range(min(count, 50))]
    blocks = [ps_pb2.BlockCodec(block_id=i, codec=valid_settings(rng)) for i in ids]
    return Plan([codecs_request(who, 10 + rng.randrange(100), (blocks * (count // len(blocks) + 1))[:count])])


@scenario("SetCodecs")
def setcodecs_many_future_changes(rng, w, who):
    """Changes for many future rounds of one block: the schedule must stay bounded."""
    block = w.block(rng)
    start = who.next_rounds.get(block.block_id, 0) + 1 + rng.randrange(1000)
    return Plan([codecs_request(who, start, [ps_pb2.BlockCodec(block_id=block.block_id, codec=valid_settings(rng))])])
