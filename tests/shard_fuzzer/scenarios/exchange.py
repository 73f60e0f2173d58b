"""Exchange streams: valid pushes, and pushes with wrong offsets, rounds, blocks, sizes,
payloads, codecs or Hellos, cut short or idle."""

from __future__ import annotations

import math
import random
import struct
import zlib

import torch

from cgx_ps.kernels import HEADER_SIZE, Codec, encode
from cgx_ps.v1 import ps_pb2

from ..settings import CAPACITY, STALL_DEADLINE_S
from ..values import U32, U64
from ..world import Identity, Plan, World, push, pushes, split
from .registry import scenario

def valid_push(rng: random.Random, w: World, who: Identity) -> tuple[ps_pb2.BlockSpec, int, bytes]:
    block = w.block(rng)
    return block, who.next_rounds.get(block.block_id, 0), rng.choice(w.payloads[block.block_id])


@scenario("Exchange")
def exchange_valid_push(rng, w, who):
    block, r, payload = valid_push(rng, w, who)
    return Plan([w.hello(who), *pushes(block.block_id, r, payload, split(rng, payload))])


@scenario("Exchange")
def exchange_push_twice_and_two_blocks(rng, w, who):
    (b1, r1, p1), (b2, r2, p2) = valid_push(rng, w, who), valid_push(rng, w, who)
    once = pushes(b1.block_id, r1, p1, split(rng, p1))
    return Plan([w.hello(who), *once, *once, *pushes(b2.block_id, r2, p2, split(rng, p2))])


@scenario("Exchange")
def exchange_bad_offsets(rng, w, who):
    block, r, payload = valid_push(rng, w, who)
    (o1, d1), (o2, d2) = split(rng, payload, 2)
    bad = rng.choice([
        [(rng.choice((1, o2, len(payload), U64)), d1)],  # first chunk not at 0
        [(0, d1), (o2 + rng.choice((1, -1, 7)), d2)],  # a gap or an overlap
        [(0, d1), (0, d1)],  # the same chunk again
    ])
    return Plan([w.hello(who), *(push(block.block_id, r, len(payload), o, d) for o, d in bad)])


@scenario("Exchange")
def exchange_bad_round(rng, w, who):
    block, r, payload = valid_push(rng, w, who)
    wrong = rng.choice([r + 2, r + 1000, U64, max(r - 1, 0) if r else r + 5])
    return Plan([w.hello(who), *pushes(block.block_id, wrong, payload, split(rng, payload))])


@scenario("Exchange")
def exchange_unknown_block(rng, w, who):
    _, r, payload = valid_push(rng, w, who)
    return Plan([w.hello(who), *pushes(rng.choice((len(w.blocks), 1000, U32)), r, payload, split(rng, payload))])


@scenario("Exchange")
def exchange_bad_sizes(rng, w, who):
    block, r, payload = valid_push(rng, w, who)
    total = len(payload)
    chunk = rng.choice([
        push(block.block_id, r, rng.choice((0, 1, total - 1, total + 1, CAPACITY + 1, U64)), 0, payload),  # wrong total
        push(block.block_id, r, total, 0, payload + b"overrun"),
        push(block.block_id, r, total, 0, b""),  # an empty chunk
    ])
    return Plan([w.hello(who), chunk])


@scenario("Exchange")
def exchange_interleaved_blocks(rng, w, who):
    (b1, r1, p1), (b2, r2, p2) = valid_push(rng, w, who), valid_push(rng, w, who)
    first = pushes(b1.block_id, r1, p1, split(rng, p1, 2))[0]
    other = pushes(b2.block_id, r2, p2, split(rng, p2, 2))[0]
    return Plan([w.hello(who), first, other])


HEADER_FIELDS = {"magic": (0, 4), "version": (4, 1), "codec": (5, 1), "bits": (6, 1), "flags": (7, 1),
                 "numel": (8, 8), "bucket": (16, 4), "crc": (20, 4), "reserved": (24, 8)}


def fix_crc(payload: bytearray) -> bytearray:
    payload[20:24] = struct.pack("<I", zlib.crc32(payload[HEADER_SIZE:]))
    return payload


@scenario("Exchange")
def exchange_corrupt_payload(rng, w, who):
    """The right size, bad content: a header field, the body (crc then catches it), or the body
    with its crc fixed up (NaN/Inf values or max-min metadata must be caught after the crc)."""
    block, r, payload = valid_push(rng, w, who)
    bad = bytearray(payload)
    how = rng.choice(("header", "body", "body-crc-fixed"))
    if how == "header":
        start, size = HEADER_FIELDS[rng.choice(list(HEADER_FIELDS))]
        bad[start:start + size] = rng.choice((b"\xff", b"\x00", rng.randbytes(1))) * size
    else:
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(HEADER_SIZE, len(bad) - 3)
            bad[at:at + 4] = struct.pack("<f", rng.choice((math.nan, math.inf, -math.inf, 3e38, -3e38, 0.0)))
        if how == "body-crc-fixed":
            fix_crc(bad)
    return Plan([w.hello(who), *pushes(block.block_id, r, bytes(bad), split(rng, bytes(bad)))])


@scenario("Exchange")
def exchange_other_codec(rng, w, who):
    """A well-formed payload of another encoding (fp16, bf16, other bits) than the round's."""
    block, r, _ = valid_push(rng, w, who)
    values = torch.randn(block.numel, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    codec = rng.choice((Codec.FP16, Codec.BF16, Codec.MAXMIN))
    payload = encode(values, codec, bits=rng.randint(1, 8), bucket_size=rng.choice((8, 64, 512, 4096))).to_bytes()
    return Plan([w.hello(who), *pushes(block.block_id, r, payload, split(rng, payload))])


@scenario("Exchange")
def exchange_cut_short(rng, w, who):
    """Half a block, then the stream is half-closed, stalls past the round timeout, or is cancelled."""
    block, r, payload = valid_push(rng, w, who)
    half = pushes(block.block_id, r, payload, split(rng, payload, 2))[:1]
    ending = rng.choice(("close", "stall", "cancel"))
    return Plan([w.hello(who), *half], ending=ending, deadline=STALL_DEADLINE_S)


@scenario("Exchange")
def exchange_bad_hello(rng, w, who):
    block, r, payload = valid_push(rng, w, who)
    first = rng.choice([
        push(block.block_id, r, len(payload), 0, payload),  # a push before the Hello
        w.hello(who, layout_hash=rng.choice(("", "0" * 64, w.layout_hash[::-1]))),
        b"",  # an ExchangeRequest with neither member of the oneof
        w.hello(who) + push(block.block_id, r, len(payload), 0, payload),  # both oneof members: the push wins
    ])
    second = rng.choice([w.hello(who), b"", push(block.block_id, r, len(payload), 0, payload)])
    return Plan([first, second])


@scenario("Exchange")
def exchange_huge_node_id(rng, w, who):
    """A stranger's Hello naming a huge node: the refusal must not echo it back."""
    return Plan([w.hello(who, node_id="n" * rng.randrange(20_000, 2_000_000))])


@scenario("Exchange")
def exchange_idle(rng, w, who):
    """A stream that never sends, or sends its Hello and nothing more."""
    return Plan(rng.choice(([], [w.hello(who)])), ending="stall")
