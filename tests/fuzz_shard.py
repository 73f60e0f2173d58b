"""Fuzz a real shard over every RPC with generated, mutated and garbage messages.

    .venv/bin/python -m tests.fuzz_shard --cases 10000 [--seed 0] [--subprocess | --in-process]

from the repository root (or as ``tests/fuzz_shard.py`` where cgx-ps is installed, as
``scripts/bootstrap.sh`` does).

Starts ``cgx-ps server`` in its own process (by default: its RSS and its log are then its own),
checks a legitimate 2-node round works (this also warms up the kernels, so the RSS baseline is
taken after them), then sends ``--cases`` calls, 16 at a time, spread evenly over the six
ParameterServer RPCs and four kinds of caller:

    no-token      no authorization metadata
    wrong-token   a missing, malformed or wrong bearer token
    stranger      the right token with no, a wrong or someone else's session id
    member        the right token and the session id of a fresh Register: the call is from a
                  member of the session, so its messages reach the service's own checks

A call's messages are one of four styles: ``generated`` from the request type's descriptor with
hostile field values (huge and negative numbers, NaN/inf, long and odd unicode strings, huge
repeated fields, several oneof members at once), ``mutated`` (bit flips, truncation, insertion,
duplication... of valid messages and of their order), ``garbage`` bytes, or a protocol
``sequence`` (pushes with wrong offsets, rounds or blocks, blob chunks out of order, streams
closed half-way, stalled or never sending; see the ``@scenario`` functions). Everything travels
as raw bytes (no serializer), so anything can be sent. Every call has a deadline of 2 s (3.5 s
for those that stall longer than the shard's own 2 s timeouts).

Afterwards it checks that the shard process is alive and SERVING, that a legitimate 2-node round
still works, that the shard's RSS stayed within a bound derived from its caps, that it logged at
most one WARNING-or-worse line per bad call and no traceback, that no call ended INTERNAL or
UNKNOWN and that no status was too large for the client to receive; exit status 1 if not.

Case ``i`` draws from its own ``random.Random(f"{seed}:{i}")``, so its messages are reproducible
(what they meet depends on the cases that ran before and beside it). The first cases are a fixed
corpus, every protocol scenario once, so even a short run covers all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import math
import os
import random
import re
import signal
import string
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
import torch
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cgx_ps.kernels import HEADER_SIZE, Codec, dequantize, encode
from cgx_ps.layout import codec_of, layout_hash
from cgx_ps.security import ChannelSecurity, new_token_file, read_token
from cgx_ps.server.cluster import launch_shard, wait_for_port_file
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker.client import ShardClient
from cgx_ps.worker.layout import Compression, TensorInfo, build_layout

__all__ = ["FuzzReport", "LogStats", "run_fuzz", "main"]

REPO = Path(__file__).resolve().parents[1]  # the shard runs from the checkout (`python -m cgx_ps.cli`)

SERVICE = "cgx_ps.v1.ParameterServer"
METHODS = ("Register", "Exchange", "PutBlob", "GetBlob", "SetCodecs", "Probe")
KINDS = ("no-token", "wrong-token", "stranger", "member")
STYLES = ("generated", "mutated", "garbage", "sequence")
STYLE_WEIGHTS = (3, 3, 1, 4)
REQUEST_TYPES: dict[str, type[Message]] = {
    "Register": ps_pb2.RegisterRequest, "Exchange": ps_pb2.ExchangeRequest, "PutBlob": ps_pb2.BlobChunk,
    "GetBlob": ps_pb2.GetBlobRequest, "SetCodecs": ps_pb2.SetCodecsRequest, "Probe": ps_pb2.ProbeChunk,
}
CLIENT_STREAMS = {"Exchange", "PutBlob", "Probe"}  # the client sends a stream of messages
SERVER_STREAMS = {"Exchange", "GetBlob"}  # the shard answers with a stream

# The shard's settings. Its memory caps are what the RSS bound is derived from.
ROUND_TIMEOUT_S = 2.0
MAX_INFLIGHT_MB = 16
MAX_MODEL_MB = 64  # the fuzz session's model state is tiny; this caps what a Register may ask for
MAX_MESSAGE = 8 << 20  # the shard's grpc.max_receive_message_length (cgx_ps.transport)
RSS_SLACK_MIB = 64  # allocator slack
CAPACITY = MAX_INFLIGHT_MB << 20

CALL_DEADLINE_S = 2.0
STALL_DEADLINE_S = ROUND_TIMEOUT_S + 1.5  # outlasts the shard's own timeouts for stalled streams
CONCURRENCY = 16  # calls in flight (threads: the calls block)
# What the shard may hold beyond its baseline, from its caps: pushed blocks, blob uploads and
# stored blobs (max-inflight each), and each call in flight its received message twice (gRPC's
# buffer and the bytes parsed from it), plus slack.
RSS_ALLOWANCE_MIB = 3 * MAX_INFLIGHT_MB + 2 * CONCURRENCY * (MAX_MESSAGE >> 20) + RSS_SLACK_MIB
HEALTH_EVERY_S = 0.25  # how often the fuzz asks the health service, timing the answer
DETAILS_LIMIT = 4096  # a status message longer than this is an echo of the request, not a reason

# ---- hostile field values --------------------------------------------------------------------------

U32, U64 = (1 << 32) - 1, (1 << 64) - 1
INT_RANGES = {"uint32": (0, U32), "uint64": (0, U64), "int32": (-(1 << 31), (1 << 31) - 1),
              "int64": (-(1 << 63), (1 << 63) - 1)}
EDGE_INTS = {
    "uint32": [0, 1, 2, 7, 8, 255, 256, 1 << 16, (1 << 24) + 8, (1 << 31) - 1, 1 << 31, U32],
    "uint64": [0, 1, 2, 31, 32, 1 << 20, CAPACITY, CAPACITY + 1, U32, 1 << 32, (1 << 53) + 1, (1 << 63) - 1,
               1 << 63, U64],
    "int32": [0, 1, -1, 5, 99, -(1 << 31), (1 << 31) - 1],
    "int64": [0, 1, -1, -64, 1 << 40, -(1 << 63), (1 << 63) - 1],
}
EDGE_DOUBLES = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, -5e-324, 1e-9, 1e-3, 0.5, 60.0,
                3600.0, math.nextafter(3600.0, math.inf), 1e308, -1e308, -1.0]
ODD_TEXT = ["", "\x00", "fuzz-node", "node-0", "%s%n%x{0}{}", "' OR 1=1 --", "\u202e\u0301\u200b", "\U0001f980" * 3,
            "\ud7ff\ue000\uffff", "\n\r\t", "../../etc/passwd", "a" * 256, "a" * 257, "é" * 129, "blob/0"]
SCALAR_KINDS = {FieldDescriptor.TYPE_UINT32: "uint32", FieldDescriptor.TYPE_UINT64: "uint64",
                FieldDescriptor.TYPE_INT32: "int32", FieldDescriptor.TYPE_INT64: "int64",
                FieldDescriptor.TYPE_ENUM: "int32"}  # proto3 enums are open: any int32 parses


def log_uniform(rng: random.Random, top: int) -> int:
    """A length or size in 0..top, small ones as likely as large ones per order of magnitude."""
    return min(top, int(2 ** rng.uniform(0, math.log2(top + 1))) - 1 + rng.randrange(2))


def pick_int(rng: random.Random, kind: str) -> int:
    if rng.random() < 0.6:
        return rng.choice(EDGE_INTS[kind])
    lo, hi = INT_RANGES[kind]
    value = rng.getrandbits(rng.randrange(1, hi.bit_length() + 1))
    return max(lo, min(hi, -value if lo < 0 and rng.random() < 0.5 else value))


def pick_double(rng: random.Random) -> float:
    r = rng.random()
    if r < 0.6:
        return rng.choice(EDGE_DOUBLES)
    if r < 0.8:
        return struct.unpack("<d", rng.randbytes(8))[0]  # any bit pattern, NaN payloads included
    return rng.uniform(-10.0, 10.0)


def random_code_point(rng: random.Random) -> str:
    while True:
        c = rng.randrange(0x110000)
        if not 0xD800 <= c <= 0xDFFF:  # lone surrogates cannot be set on a proto string
            return chr(c)


def pick_text(rng: random.Random, top: int = 4096) -> str:
    r = rng.random()
    if r < 0.35:
        return rng.choice(ODD_TEXT)
    if r < 0.37:  # huge: status messages and log lines must not echo it
        return "x" * rng.randrange(20_000, 1_000_000)
    n = log_uniform(rng, top)
    if r < 0.7:
        return "".join(rng.choices(string.printable, k=n))
    return "".join(random_code_point(rng) for _ in range(min(n, 2048)))


def pick_bytes(rng: random.Random, top: int = 1 << 16) -> bytes:
    r = rng.random()
    if r < 0.02:
        return rng.randbytes(rng.randrange(1 << 20, 4 << 20))
    if r < 0.1:
        return bytes([rng.choice((0, 0x80, 0xFF))]) * log_uniform(rng, top)
    return rng.randbytes(log_uniform(rng, top))


# ---- generated messages ------------------------------------------------------------------------------


def random_value(rng: random.Random, f: FieldDescriptor):
    if f.type in SCALAR_KINDS:
        return pick_int(rng, SCALAR_KINDS[f.type])
    if f.type == FieldDescriptor.TYPE_DOUBLE:
        return pick_double(rng)
    if f.type == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if f.type == FieldDescriptor.TYPE_STRING:
        return pick_text(rng)
    if f.type == FieldDescriptor.TYPE_BYTES:
        return pick_bytes(rng)
    raise TypeError(f"no generator for field {f.full_name} of type {f.type}")


def fill_message(rng: random.Random, message: Message, depth: int = 0) -> Message:
    """Set a random subset of ``message``'s fields (in place) to hostile values. Setting both
    members of a oneof keeps the last, so the oneof's case is random too."""
    for f in message.DESCRIPTOR.fields:
        if rng.random() < 0.35:
            continue  # unset: proto3 defaults (0, "", empty) are values worth sending too
        if f.is_repeated:
            fill_repeated(rng, message, f, depth)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            sub = getattr(message, f.name)
            sub.SetInParent()
            if depth < 4:
                fill_message(rng, sub, depth + 1)
        else:
            setattr(message, f.name, random_value(rng, f))
    return message


def fill_repeated(rng: random.Random, message: Message, f: FieldDescriptor, depth: int) -> None:
    container = getattr(message, f.name)
    huge = depth <= 1 and rng.random() < 0.03  # many elements, up to about the 8 MiB limit
    count = rng.randrange(10_000, 300_000) if huge else rng.choice((0, 1, 1, 2, 3, 5))
    if f.type != FieldDescriptor.TYPE_MESSAGE:
        value = random_value(rng, f) if huge else None
        if isinstance(value, (str, bytes)):
            value = value[:16]  # a huge list of huge strings would not fit in a message
        container.extend([value] * count if huge else [random_value(rng, f) for _ in range(count)])
        return
    if huge:
        element = type(container.add())()
        fill_message(rng, element, depth + 3)  # shallow: the count is what is huge
        del container[:]
        container.extend([element] * count)
        return
    for _ in range(count):
        fill_message(rng, container.add(), depth + 1)


def generated_message(rng: random.Random, method: str) -> bytes:
    return fill_message(rng, REQUEST_TYPES[method]()).SerializeToString()


# ---- mutations -------------------------------------------------------------------------------------

INTERESTING_BYTES = [b"\x00", b"\xff", b"\x80" * 10, b"\xff" * 9 + b"\x01", b"\x0a\xff\xff\xff\xff\x0f",
                     b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", b"\x0b", b"\x0c", b"\x7f"]


def _flip_bits(rng: random.Random, b: bytearray) -> bytearray:
    for _ in range(rng.randint(1, 8) if b else 0):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return b


def _truncate(rng: random.Random, b: bytearray) -> bytearray:
    return b[:rng.randrange(len(b) + 1)]


def _insert(rng: random.Random, b: bytearray) -> bytearray:
    at = rng.randrange(len(b) + 1)
    b[at:at] = rng.choice(INTERESTING_BYTES) if rng.random() < 0.5 else rng.randbytes(rng.randint(1, 32))
    return b


def _duplicate(rng: random.Random, b: bytearray) -> bytearray:
    if not b:
        return b
    i = rng.randrange(len(b))
    j = rng.randrange(i, len(b) + 1)
    at = rng.randrange(len(b) + 1)
    b[at:at] = b[i:j] * rng.choice((1, 2, 8))
    return b


def _delete(rng: random.Random, b: bytearray) -> bytearray:
    if b:
        i = rng.randrange(len(b))
        del b[i:i + rng.randint(1, 16)]
    return b


def _overwrite(rng: random.Random, b: bytearray) -> bytearray:
    for _ in range(rng.randint(1, 4) if b else 0):
        b[rng.randrange(len(b))] = rng.choice((0x00, 0x01, 0x7F, 0x80, 0xFF, rng.randrange(256)))
    return b


BYTE_MUTATIONS = (_flip_bits, _truncate, _insert, _duplicate, _delete, _overwrite)


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        b = rng.choice(BYTE_MUTATIONS)(rng, b)
    return bytes(b)


def mutate_sequence(rng: random.Random, messages: list[bytes]) -> list[bytes]:
    """Mutate some messages of a stream, and sometimes the stream itself (drop, repeat, swap)."""
    out = [mutate_bytes(rng, m) if rng.random() < 0.5 else m for m in messages]
    if out and all(a == b for a, b in zip(out, messages)):
        i = rng.randrange(len(out))
        out[i] = mutate_bytes(rng, out[i])
    if len(out) > 1 and rng.random() < 0.3:
        i, j = rng.randrange(len(out)), rng.randrange(len(out))
        action = rng.choice(("drop", "repeat", "swap"))
        if action == "drop":
            del out[i]
        elif action == "repeat":
            out.insert(j, out[i])
        else:
            out[i], out[j] = out[j], out[i]
    return out


def garbage(rng: random.Random) -> bytes:
    r = rng.random()
    if r < 0.5:
        return rng.randbytes(log_uniform(rng, 4096))
    if r < 0.8:  # protobuf-looking: tags of every wire type followed by arbitrary bytes
        return b"".join(bytes([rng.randrange(256)]) + rng.choice(INTERESTING_BYTES) for _ in range(rng.randint(1, 32)))
    if r < 0.98:
        return rng.randbytes(log_uniform(rng, 1 << 20))
    return rng.randbytes(MAX_MESSAGE + rng.randrange(1, 1 << 20))  # over the shard's message limit


# ---- what the fuzzer knows of the shard ----------------------------------------------------------------


@dataclass
class Identity:
    """Who a call says it is: the fields Hello, PutBlob, GetBlob and SetCodecs carry."""

    node: str
    member: int
    session_id: str
    next_rounds: dict[int, int] = field(default_factory=dict)


@dataclass
class Plan:
    """What one call sends and how it ends: ``close`` half-closes after the messages, ``stall``
    keeps the stream open until the deadline, ``cancel`` cancels the call."""

    messages: list[bytes]
    ending: str = "close"
    deadline: float = CALL_DEADLINE_S
    on_ok: Callable[[], None] | None = None  # what the fuzzer learns when the call succeeds
    scenario: str = ""  # the protocol scenario that made it, if one did


def fuzz_layout() -> ps_pb2.Layout:
    """Five blocks: one fp32, four 4-bit max-min, one of them spanning two tensors."""
    tensors = [TensorInfo("w", (64, 64)), TensorInfo("b", (64,)), TensorInfo("v", (48, 48))]
    return build_layout(tensors, 1, Compression(bits=4, bucket_size=512), block_bytes=8 << 10)


def encode_block(block: ps_pb2.BlockSpec, values: torch.Tensor, codec: Codec | None = None) -> bytes:
    s = block.codec
    codec = codec if codec is not None else codec_of(s)
    return encode(values, codec, bits=s.bits or 4, bucket_size=s.bucket_size or 512, seed=1).to_bytes()


class World:
    """The fuzz session: its layout, valid payloads for each block, blob keys put, and fresh
    members. All member cases register as members of one node ("fuzz-node", num_nodes=1), so
    valid pushes complete rounds and nobody waits for a second node that never comes."""

    NODE = "fuzz-node"

    def __init__(self, seed: int) -> None:
        self.layout = fuzz_layout()
        self.layout_hash = layout_hash(self.layout)
        self.blocks = list(self.layout.blocks)
        gen = torch.Generator().manual_seed(seed)
        self.payloads = {b.block_id: [encode_block(b, torch.randn(b.numel, generator=gen), Codec.FP32),
                                      encode_block(b, torch.randn(b.numel, generator=gen))] for b in self.blocks}
        # valid layouts (right hash) that this shard must still refuse, or that start another job
        self.foreign_layouts = {
            "two-shards": build_layout([TensorInfo("w", (64, 64))], 2, Compression(bits=4, bucket_size=512)),
            "huge-block": build_layout([TensorInfo("w", (3000, 2000))], 1, Compression(bits=None),
                                       block_bytes=64 << 20),
            "other-model": build_layout([TensorInfo("z", (32, 32))], 1, Compression(bits=None)),
        }
        self.job = "fuzz"
        self._jobs = itertools.count(1)
        self.session_id = ""  # the last one Register returned: strangers may know it
        self.blob_keys: list[str] = []
        self._members = itertools.count(1)
        self.register_failures: Counter[str] = Counter()  # refusals of the members' Registers
        self.not_joined = 0  # member cases that went on without a membership

    def register_request(self, **changes) -> ps_pb2.RegisterRequest:
        """The members' Register (a fresh member unless ``changes`` name one), with ``changes``."""
        fields = dict(node_id=self.NODE, num_nodes=1, layout=self.layout, layout_hash=self.layout_hash,
                      job_id=self.job, client_version="fuzz")
        fields.update(changes)
        if "member" not in fields:
            fields["member"] = self.fresh_member()
        return ps_pb2.RegisterRequest(**fields)

    def fresh_member(self) -> int:
        return next(self._members)

    async def join(self, channel: grpc.aio.Channel, metadata) -> Identity:
        """Register a fresh member of the session (starting one if none is running). A failure
        (say, another job holds the shard) leaves an identity that is not a member."""
        member = self.fresh_member()
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        for _attempt in range(3):
            job = self.job
            try:
                reply = await stub.Register(self.register_request(member=member, job_id=job), metadata=metadata,
                                            timeout=CALL_DEADLINE_S)
                self.session_id = reply.session_id
                return Identity(self.NODE, member, reply.session_id, dict(zip(reply.block_ids, reply.next_rounds)))
            except grpc.aio.AioRpcError as exc:
                self.register_failures[f"{exc.code().name}: {(exc.details() or '')[:70]}"] += 1
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # a fuzzed Register of this job started a session with another layout or node
                    # count: a new job id takes the shard back once that session is idle
                    # Only the first of the concurrent joins refused for this job moves on: if each
                    # moved on, whoever started job N would hold the shard against job N+1, N+2...
                    if self.job == job:
                        self.job = f"fuzz-{next(self._jobs)}"
                elif exc.code() != grpc.StatusCode.UNAVAILABLE:
                    break
                await asyncio.sleep(0.1)  # busy with another job: its streams are closing
        self.not_joined += 1
        return Identity(self.NODE, member, self.session_id)

    def stranger(self, rng: random.Random) -> Identity:
        """The right token but not a member: no, a wrong, or someone else's session id."""
        return rng.choice([
            lambda: Identity(self.NODE, self.fresh_member(), self.session_id),  # knows the id, never registered
            lambda: Identity(self.NODE, 1, rng.randbytes(16).hex()),  # an early member's name, wrong id
            lambda: Identity(self.NODE, 1, ""),
            lambda: Identity(pick_text(rng, 300), pick_int(rng, "uint32"), pick_text(rng, 64)),
        ])()

    def block(self, rng: random.Random) -> ps_pb2.BlockSpec:
        return rng.choice(self.blocks)

    def hello(self, who: Identity, **changes) -> bytes:
        fields = dict(node_id=who.node, layout_hash=self.layout_hash, member=who.member, session_id=who.session_id)
        fields.update(changes)
        return ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(**fields)).SerializeToString()


def push(block_id: int, round_: int, total: int, offset: int, data: bytes) -> bytes:
    return ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(round=round_, block_id=block_id, total_bytes=total,
                                                        offset=offset, data=data)).SerializeToString()


def split(rng: random.Random, data: bytes, pieces: int | None = None) -> list[tuple[int, bytes]]:
    """(offset, piece) for ``data`` cut at random places into non-empty pieces."""
    n = pieces or rng.randint(1, 4)
    cuts = sorted(set(rng.randrange(1, len(data)) for _ in range(n - 1))) if len(data) > 1 else []
    bounds = [0, *cuts, len(data)]
    return [(a, data[a:b]) for a, b in zip(bounds, bounds[1:])]


def pushes(block_id: int, round_: int, payload: bytes, pieces: list[tuple[int, bytes]]) -> list[bytes]:
    return [push(block_id, round_, len(payload), off, piece) for off, piece in pieces]


def blob_chunks(key: str, data: bytes, who: Identity, pieces: list[tuple[int, bytes]], total: int | None = None
                ) -> list[bytes]:
    total = len(data) if total is None else total
    return [ps_pb2.BlobChunk(key=key, total_bytes=total, offset=off, data=piece, node_id=who.node, member=who.member,
                             session_id=who.session_id).SerializeToString() for off, piece in pieces or [(0, b"")]]


# ---- protocol sequences ---------------------------------------------------------------------------------

Scenario = Callable[[random.Random, World, Identity], Plan]
SCENARIOS: dict[str, list[Scenario]] = {m: [] for m in METHODS}


def scenario(method: str) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        SCENARIOS[method].append(fn)
        return fn
    return register


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


@scenario("PutBlob")
def putblob_valid(rng, w, who):
    key = f"blob/{rng.randrange(1 << 30)}"
    data = rng.randbytes(log_uniform(rng, 200_000))
    return Plan(blob_chunks(key, data, who, split(rng, data)), on_ok=lambda: w.blob_keys.append(key))


@scenario("PutBlob")
def putblob_again(rng, w, who):
    """A key already put: with the same bytes (a retry) or other bytes (ALREADY_EXISTS)."""
    key = rng.choice(w.blob_keys) if w.blob_keys else "blob/0"
    data = rng.randbytes(rng.randrange(1, 64))
    return Plan(blob_chunks(key, data, who, split(rng, data)))


@scenario("PutBlob")
def putblob_bad_chunks(rng, w, who):
    key, data = f"blob/{rng.randrange(1 << 30)}", rng.randbytes(rng.randrange(8, 5000))
    pieces = split(rng, data, rng.randint(2, 5))
    chunks = blob_chunks(key, data, who, pieces)
    how = rng.choice(("shuffle", "gap", "overrun", "key", "total"))
    if how == "shuffle":
        rng.shuffle(chunks)
        chunks = chunks if chunks != blob_chunks(key, data, who, pieces) else chunks[::-1]
    elif how == "gap":
        del chunks[rng.randrange(len(chunks) - 1)]
    elif how == "overrun":
        chunks.append(blob_chunks(key, b"more", who, [(len(data), b"more")], total=len(data))[0])
    else:
        off, piece = pieces[-1]
        changed = dict(key=key + "x") if how == "key" else dict(total_bytes=len(data) + 1)
        last = ps_pb2.BlobChunk(key=key, total_bytes=len(data), offset=off, data=piece, node_id=who.node,
                                member=who.member, session_id=who.session_id)
        for name, value in changed.items():
            setattr(last, name, value)
        chunks[-1] = last.SerializeToString()
    return Plan(chunks)


@scenario("PutBlob")
def putblob_bad_key(rng, w, who):
    key = rng.choice(("", "k" * 257, "é" * 129, "\x00"))
    return Plan(blob_chunks(key, b"data", who, [(0, b"data")]))


@scenario("PutBlob")
def putblob_too_big(rng, w, who):
    total = rng.choice((CAPACITY, CAPACITY + 1, 1 << 40, U64))
    return Plan(blob_chunks(f"big/{rng.randrange(1 << 30)}", b"x", who, [(0, b"x")], total=total))


@scenario("PutBlob")
def putblob_large(rng, w, who):
    """A few MiB in 1 MiB chunks: stored until the session ends, within the blob capacity."""
    data = bytes(rng.randrange(1, 4) << 20)
    return Plan(blob_chunks(f"large/{rng.randrange(1 << 30)}", data, who, [(o, data[o:o + (1 << 20)])
                                                                             for o in range(0, len(data), 1 << 20)]))


@scenario("PutBlob")
def putblob_cut_short(rng, w, who):
    data = rng.randbytes(rng.randrange(100, 5000))
    first = blob_chunks(f"cut/{rng.randrange(1 << 30)}", data, who, split(rng, data, 2))[:1]
    return Plan(first, ending=rng.choice(("close", "stall", "cancel")), deadline=STALL_DEADLINE_S)


@scenario("PutBlob")
def putblob_empty_and_idle(rng, w, who):
    return Plan([], ending=rng.choice(("close", "stall")))


@scenario("PutBlob")
def putblob_zero_length(rng, w, who):
    key = f"empty/{rng.randrange(1 << 30)}"
    return Plan(blob_chunks(key, b"", who, []), on_ok=lambda: w.blob_keys.append(key))


def get_request(key: str, timeout_s: float, who: Identity) -> bytes:
    return ps_pb2.GetBlobRequest(key=key, timeout_s=timeout_s, session_id=who.session_id).SerializeToString()


@scenario("GetBlob")
def getblob_existing(rng, w, who):
    key = rng.choice(w.blob_keys) if w.blob_keys else "blob/0"
    return Plan([get_request(key, 0.5, who)])


@scenario("GetBlob")
def getblob_missing(rng, w, who):
    return Plan([get_request(f"missing/{rng.randrange(1 << 30)}", rng.choice((0.01, 0.2, 1.0)), who)])


@scenario("GetBlob")
def getblob_bad_timeout(rng, w, who):
    timeout_s = rng.choice((math.nan, math.inf, -math.inf, -1.0, 3600.5, 1e308, 5e-324, 0.0))
    return Plan([get_request(f"missing/{rng.randrange(1 << 30)}", timeout_s, who)])


@scenario("GetBlob")
def getblob_bad_key(rng, w, who):
    return Plan([get_request(rng.choice(("", "k" * 257, "é" * 129)), 0.1, who)])


@scenario("GetBlob")
def getblob_cancelled(rng, w, who):
    return Plan([get_request(f"missing/{rng.randrange(1 << 30)}", 30.0, who)], ending="cancel")


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


def probe_chunks(sizes: list[int]) -> list[bytes]:
    return [ps_pb2.ProbeChunk(data=bytes(n)).SerializeToString() for n in sizes]


@scenario("Probe")
def probe_valid(rng, w, who):
    return Plan(probe_chunks([log_uniform(rng, 2 << 20) for _ in range(rng.randint(1, 5))]))


@scenario("Probe")
def probe_empty(rng, w, who):
    return Plan([])


@scenario("Probe")
def probe_stall(rng, w, who):
    """One chunk, then silence past the round timeout: the shard must end the call itself."""
    return Plan(probe_chunks([rng.randrange(1, 1000)]), ending="stall", deadline=STALL_DEADLINE_S)


@scenario("Probe")
def probe_idle_or_cancelled(rng, w, who):
    return Plan(probe_chunks([100] * rng.randint(0, 3)), ending=rng.choice(("stall", "cancel")))


@scenario("Probe")
def probe_oversized(rng, w, who):
    return Plan(probe_chunks([MAX_MESSAGE + rng.randrange(1, 1 << 20)]))


@scenario("Register")
def register_valid(rng, w, who):
    return Plan([w.register_request().SerializeToString()])


@scenario("Register")
def register_bad_fields(rng, w, who):
    change = rng.choice([
        dict(layout_hash=rng.choice(("", "0" * 64, w.layout_hash.upper()))),
        dict(num_nodes=rng.choice((0, 2, U32))),
        dict(node_id=rng.choice(("", "n" * 257, "n" * rng.randrange(20_000, 1_000_000)))),
        dict(job_id="j" * rng.choice((257, 100_000))),
        dict(node_id="intruder", member=rng.choice((0, U32))),
    ])
    return Plan([w.register_request(**change).SerializeToString()])


def broken_layout(rng: random.Random, base: ps_pb2.Layout) -> ps_pb2.Layout:
    """A layout that fails validation in one way, its tensor names sometimes huge (the error
    names a tensor: the refusal must not echo a megabyte back)."""
    layout = ps_pb2.Layout()
    layout.CopyFrom(base)
    if rng.random() < 0.5:
        layout.tensors[0].name = "t" * rng.randrange(20_000, 1_000_000)
    block, tensor = layout.blocks[-1], layout.tensors[0]
    how = rng.choice(("order", "shard", "codec", "index", "offset", "numel", "shape", "names", "shards"))
    if how == "order":
        block.block_id += 7
    elif how == "shard":
        block.shard = 3
    elif how == "codec":
        block.codec.bits = 0
    elif how == "index":
        block.segments[0].tensor_index = U32
    elif how == "offset":
        layout.blocks[0].segments[0].offset = 1
    elif how == "numel":
        block.numel += 1
    elif how == "shape":
        tensor.shape[:] = [-x for x in tensor.shape]
    elif how == "names":
        layout.tensors[1].name = tensor.name
    else:
        layout.num_shards = 0
    return layout


@scenario("Register")
def register_bad_layout(rng, w, who):
    layout = broken_layout(rng, w.layout)
    request = w.register_request(layout=layout, layout_hash=layout_hash(layout))
    return Plan([request.SerializeToString()])


@scenario("Register")
def register_foreign_layout(rng, w, who):
    """Valid layouts (right hash) this shard must refuse: two shards, a block over the in-flight
    cap, another model than the session's, or the session's with a huge tensor name."""
    name = rng.choice(list(w.foreign_layouts) + ["huge-name"])
    if name == "huge-name":
        layout = ps_pb2.Layout()
        layout.CopyFrom(w.layout)
        layout.tensors[0].name = "a" + "t" * rng.randrange(20_000, 1_000_000)  # still sorts first
    else:
        layout = w.foreign_layouts[name]
    request = w.register_request(layout=layout, layout_hash=layout_hash(layout))
    return Plan([request.SerializeToString()])


@scenario("Register")
def register_another_job(rng, w, who):
    """Another job: refused while the fuzz session is busy, takes the shard over when it is idle
    (the next member case's Register takes it back)."""
    layout = w.foreign_layouts["other-model"]
    request = w.register_request(member=0, node_id="intruder", job_id=f"intruder-{rng.randrange(100)}",
                                 layout=layout, layout_hash=layout_hash(layout))
    return Plan([request.SerializeToString()])


# ---- cases and their plans ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    index: int
    method: str
    kind: str
    style: str
    scenario: str = ""  # for the sequence style: which one (the corpus names it, else random)


def make_cases(count: int, seed: int) -> list[Case]:
    """First the corpus, every scenario once from a member and once from a stranger, then cases
    that go round the methods and kinds (so every pair gets its share) with a random style."""
    corpus = [(m, kind, fn.__name__) for m in METHODS for kind in ("member", "stranger") for fn in SCENARIOS[m]]
    cases = [Case(i, m, kind, "sequence", name) for i, (m, kind, name) in enumerate(corpus[:count])]
    for i in range(len(cases), count):
        rng = case_rng(seed, i, "style")
        cases.append(Case(i, METHODS[i % len(METHODS)], KINDS[(i // len(METHODS)) % len(KINDS)],
                          rng.choices(STYLES, STYLE_WEIGHTS)[0]))
    return cases


def case_rng(seed: int, index: int, purpose: str = "") -> random.Random:
    return random.Random(f"{seed}:{index}:{purpose}")  # str seeds hash deterministically (sha512)


def plan_for(case: Case, rng: random.Random, w: World, who: Identity) -> Plan:
    if case.style == "sequence":
        scenarios = SCENARIOS[case.method]
        fn = next((s for s in scenarios if s.__name__ == case.scenario), None) or rng.choice(scenarios)
        plan = fn(rng, w, who)
        plan.scenario = fn.__name__
        return plan
    if case.style == "mutated":
        base = valid_plan(case.method, rng, w, who)
        return Plan(mutate_sequence(rng, base.messages), deadline=CALL_DEADLINE_S)
    count = rng.randint(0, 4) if case.method in CLIENT_STREAMS else 1
    if case.style == "garbage":
        return Plan([garbage(rng) for _ in range(count)])
    return Plan(generated_stream(case.method, rng, w, who, count))


def valid_plan(method: str, rng: random.Random, w: World, who: Identity) -> Plan:
    """A valid call of ``method`` (for this caller), the base that mutations start from."""
    valid = {"Register": register_valid, "Exchange": exchange_valid_push, "PutBlob": putblob_valid,
             "GetBlob": getblob_existing, "SetCodecs": setcodecs_valid, "Probe": probe_valid}[method]
    return valid(rng, w, who)


def generated_stream(method: str, rng: random.Random, w: World, who: Identity, count: int) -> list[bytes]:
    """Generated messages; a member's carry its identity half the time, so they get past the
    membership checks to the field checks behind them."""
    messages = []
    for i in range(count):
        message = fill_message(rng, REQUEST_TYPES[method]())
        if rng.random() < 0.5:
            wear_identity(message, who, w)
        if method == "Exchange" and i == 0 and rng.random() < 0.5:
            message = ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id=who.node, layout_hash=w.layout_hash,
                                                                member=who.member, session_id=who.session_id))
        messages.append(message.SerializeToString())
    return messages


def wear_identity(message: Message, who: Identity, w: World) -> None:
    """Make a generated message claim the caller's identity, in the fields it has of these."""
    fields = message.DESCRIPTOR.fields_by_name
    target = message.hello if "hello" in fields and message.WhichOneof("kind") == "hello" else message
    names = target.DESCRIPTOR.fields_by_name
    for name, value in (("node_id", who.node), ("member", who.member), ("session_id", who.session_id),
                        ("layout_hash", w.layout_hash)):
        if name in names:
            setattr(target, name, value)


def metadata_for(kind: str, rng: random.Random, token: str) -> tuple[tuple[str, str], ...]:
    if kind == "no-token":
        return rng.choice(((), (("x-fuzz", "1"),)))
    if kind == "wrong-token":
        wrong = "".join(rng.choices(string.ascii_letters + string.digits + "-_", k=len(token)))
        value = rng.choice([f"Bearer {wrong}", "Bearer", "Bearer ", token, f"Basic {token}", f"Bearer {token[:-1]}",
                            f"Bearer {token}x", f"Bearer {token[:-1]}{chr(ord(token[-1]) ^ 1)}",
                            "Bearer " + "A" * rng.randrange(1000, 7000)])
        return (("authorization", value),)
    return (("authorization", f"Bearer {token}"),)


# ---- making the calls ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    code: str
    details: str = ""


def call(channel: grpc.Channel, method: str, plan: Plan, metadata) -> Outcome:
    """Send a plan's raw messages on ``method`` and return how the shard ended the call.

    Blocking gRPC, run on a thread: grpc.aio turns a write that comes after the shard has ended
    the call into a local INTERNAL ("Internal error from Core") and loses the shard's status;
    the blocking API stops writing then and reports the status the shard sent."""
    path = f"/{SERVICE}/{method}"
    try:
        if method in CLIENT_STREAMS:
            return client_stream(channel, path, method in SERVER_STREAMS, plan, metadata)
        message = plan.messages[0] if plan.messages else b""
        if method not in SERVER_STREAMS:
            channel.unary_unary(path)(message, metadata=metadata, timeout=plan.deadline)
            return Outcome("OK")
        responses = channel.unary_stream(path)(message, metadata=metadata, timeout=plan.deadline)
        if plan.ending == "cancel":
            threading.Timer(0.05, responses.cancel).start()
        return finish(responses, read=True)
    except grpc.RpcError as exc:
        return Outcome(exc.code().name, exc.details() or "")


def client_stream(channel: grpc.Channel, path: str, server_streams: bool, plan: Plan, metadata) -> Outcome:
    """A client-streaming call: the plan's messages, then a half-close (``close``), nothing until
    the call ends (``stall``) or a cancel (``cancel``)."""
    started, ended = threading.Event(), threading.Event()
    holder: list = []

    def requests():
        yield from plan.messages
        if plan.ending == "cancel":
            started.wait()
            time.sleep(0.05)
            holder[0].cancel()
        if plan.ending != "close":
            ended.wait(plan.deadline + 5)  # no half-close: the stream stays open until it ends

    if server_streams:
        rpc = channel.stream_stream(path)(requests(), metadata=metadata, timeout=plan.deadline)
    else:
        rpc = channel.stream_unary(path).future(requests(), metadata=metadata, timeout=plan.deadline)
    holder.append(rpc)
    started.set()
    rpc.add_done_callback(lambda *_: ended.set())
    return finish(rpc, read=server_streams)


def finish(rpc, read: bool) -> Outcome:
    """Wait for the end of a call (reading and dropping a server stream's responses, so flow
    control never holds the shard) and return its status."""
    try:
        if read:
            for _ in rpc:
                pass
        else:
            rpc.result()
    except (grpc.RpcError, grpc.FutureCancelledError):
        pass
    return Outcome(rpc.code().name, rpc.details() or "")


# ---- the shard under test --------------------------------------------------------------------------------


def shard_flags(token_file: str) -> list[str]:
    return ["--host", "127.0.0.1", "--port", "0", "--token-file", token_file,
            "--metrics-port", "-1", "--round-timeout", str(ROUND_TIMEOUT_S), "--max-inflight-mb", str(MAX_INFLIGHT_MB),
            "--max-model-mb", str(MAX_MODEL_MB), "--drain-timeout", "2", "--log-level", "INFO"]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class SubprocessShard:
    """``python -m cgx_ps.cli server`` with its stdout and stderr in a file."""

    def __init__(self, workdir: Path, token_file: str) -> None:
        self.workdir, self.token_file = workdir, token_file
        self.log_path = workdir / "shard.log"
        self.proc: subprocess.Popen | None = None
        self.address = ""

    async def start(self, timeout_s: float = 120.0) -> None:
        port_file = self.workdir / "port.json"
        with open(self.log_path, "wb") as out:  # the child keeps its own descriptor
            self.proc = launch_shard(shard_flags(self.token_file), port_file, stdout=out, stderr=subprocess.STDOUT,
                                     cwd=REPO)
        try:
            info = await asyncio.to_thread(wait_for_port_file, self.proc, port_file, time.monotonic() + timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"the shard {exc}: {self.log_path.read_text()[-2000:]}") from None
        self.address = f"127.0.0.1:{info['port']}"

    def rss_kib(self) -> int:
        return rss_kib(self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    async def stop(self) -> int | None:
        """SIGTERM (the graceful drain) and its exit status; killed after 20 s."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        for _ in range(200):
            if self.proc.poll() is not None:
                return self.proc.returncode
            await asyncio.sleep(0.1)
        self.proc.kill()
        return self.proc.wait()


class InProcessShard:
    """A ShardServer in the fuzzer's own event loop, for debugging (breakpoints, tracebacks): its
    RSS is then the fuzzer's too, and gRPC's own stderr lines are not in its log."""

    def __init__(self, workdir: Path, token_file: str) -> None:
        self.log_path = workdir / "shard.log"
        self.token_file = token_file
        self.server = None
        self.address = ""
        self._handler: logging.Handler | None = None

    async def start(self) -> None:
        from cgx_ps.server import ServerConfig, ShardServer
        self._handler = logging.FileHandler(self.log_path)
        self._handler.setFormatter(logging.Formatter(
            "%(asctime)s level=%(levelname)s shard=0 pid=%(process)d logger=%(name)s msg=%(message)r"))
        logger = logging.getLogger("cgx_ps")
        logger.addHandler(self._handler)
        logger.setLevel(logging.INFO)
        self.server = ShardServer(ServerConfig(
            host="127.0.0.1", port=0, metrics_port=-1, round_timeout_s=ROUND_TIMEOUT_S, drain_timeout_s=2.0,
            max_inflight_bytes=CAPACITY, max_model_bytes=MAX_MODEL_MB << 20, token_file=self.token_file))
        await self.server.start()
        self.address = f"127.0.0.1:{self.server.port}"

    def rss_kib(self) -> int:
        return rss_kib(os.getpid())

    def alive(self) -> bool:
        return self.server is not None and not self.server._stopping

    def log_lines(self) -> list[str]:
        self._handler.flush()
        return self.log_path.read_text(errors="replace").splitlines()

    async def stop(self) -> int | None:
        await self.server.stop(drain=True)
        logging.getLogger("cgx_ps").removeHandler(self._handler)
        self._handler.close()
        return 0


class RssSampler:
    """The shard's RSS, sampled every 50 ms while the fuzz runs."""

    def __init__(self, shard) -> None:
        self.shard, self.samples, self._task = shard, [], None

    async def _run(self) -> None:
        while True:
            try:
                self.samples.append(self.shard.rss_kib())
            except OSError:
                return  # the process is gone: the report says so
            await asyncio.sleep(0.05)

    @property
    def peak_kib(self) -> int:
        return max(self.samples, default=0)

    def quarter_peaks_kib(self) -> list[int]:
        """The peak of each quarter of the run: a plateau, not a climb, if nothing leaks."""
        n = len(self.samples)
        return [max(self.samples[i * n // 4:(i + 1) * n // 4], default=0) for i in range(4)]

    def __enter__(self) -> "RssSampler":
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()


class HealthWatch:
    """Asks the health service every HEALTH_EVERY_S while the fuzz runs and keeps the slowest
    answer: how long the shard's event loop was ever too busy to serve anyone."""

    def __init__(self, address: str) -> None:
        self.address, self.worst_s, self.failures, self._task = address, 0.0, 0, None

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                t0 = time.monotonic()
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=60)
                except grpc.aio.AioRpcError:
                    self.failures += 1
                self.worst_s = max(self.worst_s, time.monotonic() - t0)
                await asyncio.sleep(HEALTH_EVERY_S)

    def __enter__(self) -> "HealthWatch":
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()


# ---- the shard's log -------------------------------------------------------------------------------------

LOG_LINE = re.compile(r"^\S+ \S+ level=(?P<level>\w+) shard=\S+ pid=\d+ logger=(?P<logger>\S+) msg=(?P<msg>.*)$")
GATE_LINE = re.compile(r"^['\"](?P<method>Register|Exchange|PutBlob|GetBlob|SetCodecs|Probe) (refused|from) ")


@dataclass
class LogStats:
    lines: int = 0
    by_level: Counter = field(default_factory=Counter)
    raw: int = 0  # lines not written by the shard's log formatter (gRPC core, warnings, tracebacks)
    tracebacks: int = 0
    by_method: Counter = field(default_factory=Counter)  # WARNING-or-worse lines, by the method they name
    longest: int = 0

    @property
    def problem_lines(self) -> int:
        """Lines a bad call may cause: anything at WARNING or above, and anything unformatted."""
        return self.raw + sum(n for level, n in self.by_level.items() if level not in ("DEBUG", "INFO"))


def attribute(logger: str, msg: str) -> str:
    """Which method a WARNING-or-worse line is about: the gate names it; the service's own lines
    are about Exchange streams (pushes, readers) and their rounds."""
    gate = GATE_LINE.match(msg)
    if gate:
        return gate["method"]
    if logger in ("cgx_ps.server.service", "cgx_ps.server.aggregator"):
        return "Exchange"
    return "other"


def analyse_log(lines: list[str]) -> LogStats:
    stats = LogStats(lines=len(lines))
    for line in lines:
        stats.longest = max(stats.longest, len(line))
        stats.tracebacks += "Traceback (most recent call last)" in line
        m = LOG_LINE.match(line)
        if m is None:
            stats.raw += 1
            stats.by_method["other"] += 1
            continue
        stats.by_level[m["level"]] += 1
        if m["level"] not in ("DEBUG", "INFO"):
            stats.by_method[attribute(m["logger"], m["msg"])] += 1
    return stats


# ---- the report ------------------------------------------------------------------------------------------


@dataclass
class FuzzReport:
    cases: int
    seed: int
    mode: str = "subprocess"
    seconds: float = 0.0  # the fuzz calls alone
    codes: Counter = field(default_factory=Counter)  # status code -> calls
    by_method: dict[str, Counter] = field(default_factory=lambda: {m: Counter() for m in METHODS})
    by_kind: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    by_style: Counter = field(default_factory=Counter)
    scenarios_run: set[str] = field(default_factory=set)
    bad_calls: Counter = field(default_factory=Counter)  # method -> calls that did not end OK
    oversized_details: int = 0  # statuses that were (or would have been) too large to deliver
    fuzzer_errors: int = 0  # exceptions in the fuzzer itself, or calls that outlived their deadline
    alarms: list[str] = field(default_factory=list)  # one line per alarming call (the first 20)
    alarm_kinds: Counter = field(default_factory=Counter)  # "method: code: details" (digits as N) -> calls
    register_failures: Counter = field(default_factory=Counter)  # the members' own Registers
    members_not_joined: int = 0  # member cases whose Register failed (they ran as strangers)
    log: LogStats = field(default_factory=LogStats)  # the fuzz phase only
    rss_start_kib: int = 0
    rss_peak_kib: int = 0
    rss_end_kib: int = 0
    rss_bound_kib: int = 0
    rss_quarter_peaks_kib: list[int] = field(default_factory=list)
    health_worst_s: float = 0.0  # the slowest health check during the fuzz
    alive: bool = False
    serving: bool = False
    exchange_before: str | None = "not run"  # None: the legitimate 2-node round worked
    exchange_after: str | None = "not run"
    exit_code: int | None = None  # after SIGTERM, at the end

    @property
    def total_bad_calls(self) -> int:
        return sum(self.bad_calls.values())

    def record(self, case: Case, scenario_name: str, outcome: Outcome) -> None:
        self.codes[outcome.code] += 1
        self.by_method[case.method][outcome.code] += 1
        self.by_kind[case.kind][outcome.code] += 1
        self.by_style[case.style] += 1
        if scenario_name:
            self.scenarios_run.add(scenario_name)
        if outcome.code != "OK":
            self.bad_calls[case.method] += 1
        oversized = len(outcome.details) > DETAILS_LIMIT or "metadata size exceeds" in outcome.details
        self.oversized_details += oversized
        if outcome.code in ("INTERNAL", "UNKNOWN") or oversized:
            self.alarm(case, scenario_name, f"{outcome.code}: {outcome.details[:200]!r} ({len(outcome.details)} chars)")

    def alarm(self, case: Case, scenario_name: str, text: str) -> None:
        self.alarm_kinds[re.sub(r"\d+", "N", f"{case.method}: {text}")[:110]] += 1
        if len(self.alarms) < 20:
            self.alarms.append(f"case {case.index} {case.method}/{case.kind}/{case.style}"
                               f"{'/' + scenario_name if scenario_name else ''}: {text}")

    def checks(self) -> dict[str, str | None]:
        """Each property the fuzz run must leave true: None when it holds, else why not."""
        lines_over = {m: (n, self.bad_calls[m]) for m, n in self.log.by_method.items()
                      if m != "other" and n > self.bad_calls[m]}
        return {
            "alive": None if self.alive else "the shard process died",
            "serving": None if self.serving else "the health service does not say SERVING",
            "warm-up": self.exchange_before and f"a 2-node round failed before the fuzz: {self.exchange_before}",
            "exchange": self.exchange_after and f"a legitimate 2-node round failed afterwards: {self.exchange_after}",
            "rss": None if self.rss_peak_kib <= self.rss_bound_kib else
            f"peak RSS {self.rss_peak_kib} KiB over the bound of {self.rss_bound_kib} KiB",
            "log_lines": None if self.log.problem_lines <= self.total_bad_calls and not lines_over else
            f"{self.log.problem_lines} WARNING-or-worse lines for {self.total_bad_calls} bad calls; per method "
            f"(lines, bad calls) over: {lines_over}",
            "tracebacks": None if self.log.tracebacks == 0 else f"{self.log.tracebacks} tracebacks in the log",
            "unknown": None if self.codes["UNKNOWN"] == 0 else f"{self.codes['UNKNOWN']} calls ended UNKNOWN",
            "internal": None if self.codes["INTERNAL"] == 0 else f"{self.codes['INTERNAL']} calls ended INTERNAL",
            "details": None if self.oversized_details == 0 else
            f"{self.oversized_details} statuses were too large to deliver (the shard echoed the request)",
            "fuzzer": None if self.fuzzer_errors == 0 else f"{self.fuzzer_errors} fuzzer errors or hung calls",
        }

    def problems(self) -> list[str]:
        return [f"{name}: {why}" for name, why in self.checks().items() if why]

    def summary(self) -> str:
        mib = lambda kib: f"{kib / 1024:.0f} MiB"  # noqa: E731
        out = [
            f"fuzz_shard: {self.cases} cases, seed {self.seed}, shard {self.mode}, {self.seconds:.1f} s "
            f"({self.cases / max(self.seconds, 1e-9):.0f} calls/s, {CONCURRENCY} at a time)",
            f"  status codes: {dict(self.codes.most_common())}",
            *(f"    {m:<10} {dict(c.most_common())}" for m, c in self.by_method.items()),
            *(f"    {k:<12} {dict(c.most_common())}" for k, c in self.by_kind.items()),
            f"  styles: {dict(self.by_style)}; protocol scenarios run: {len(self.scenarios_run)}",
            f"  bad calls (not OK): {self.total_bad_calls} {dict(self.bad_calls)}",
            f"  shard log during the fuzz: {self.log.lines} lines {dict(self.log.by_level)}, {self.log.raw} raw, "
            f"{self.log.tracebacks} tracebacks, longest {self.log.longest} chars; WARNING-or-worse by method "
            f"{dict(self.log.by_method)}",
            f"  RSS: start {mib(self.rss_start_kib)}, peak {mib(self.rss_peak_kib)}, end {mib(self.rss_end_kib)}, "
            f"bound {mib(self.rss_bound_kib)} (start + {RSS_ALLOWANCE_MIB} MiB: 3 x {MAX_INFLIGHT_MB} MiB in flight, "
            f"2 x {CONCURRENCY} messages of {MAX_MESSAGE >> 20} MiB, {RSS_SLACK_MIB} MiB slack); peak per quarter of "
            f"the run {', '.join(mib(k) for k in self.rss_quarter_peaks_kib)}",
            f"  slowest health check during the fuzz: {self.health_worst_s:.2f} s",
            f"  alive {self.alive}, SERVING {self.serving}, 2-node round before: {self.exchange_before or 'ok'}, "
            f"after: {self.exchange_after or 'ok'}, exit status after SIGTERM {self.exit_code}",
            f"  members' own Registers refused: {dict(self.register_failures) or 0}; member cases that ran "
            f"without a membership: {self.members_not_joined}",
            *(f"  alarms: {n:>4} x {kind}" for kind, n in self.alarm_kinds.most_common()),
            *(f"  alarm: {a}" for a in self.alarms),
        ]
        problems = self.problems()
        out.append("  PROBLEMS:\n    " + "\n    ".join(problems) if problems else "  all checks passed")
        return "\n".join(out)


# ---- the run ---------------------------------------------------------------------------------------------


async def legitimate_round(address: str, token_file: str, job: str) -> str | None:
    """Two nodes with the token complete a round and get identical bytes, the sum; None if so."""
    layout = build_layout([TensorInfo("w", (64, 64))], 1, Compression(bits=4, bucket_size=512))
    security = ChannelSecurity(token_file=token_file)
    clients = [ShardClient(address, f"node-{i}", 2, layout, connect_timeout_s=20, job_id=job, security=security)
               for i in range(2)]
    try:
        await asyncio.wait_for(asyncio.gather(*(c.connect() for c in clients)), 30)
        values = [torch.full((4096,), float(i + 1)) for i in range(2)]
        payloads = [encode(v, Codec.FP32).to_bytes() for v in values]
        results = await asyncio.wait_for(asyncio.gather(*(c.exchange(0, 0, p) for c, p in zip(clients, payloads))), 30)
        if results[0] != results[1]:
            return "the two nodes got different results"
        if not torch.equal(dequantize(results[0]), values[0] + values[1]):
            return "the result is not the sum"
        return None
    except Exception as exc:  # noqa: BLE001 - the report says what went wrong
        return f"{type(exc).__name__}: {exc}"
    finally:
        for c in clients:
            await c.close()


async def health_serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            for service in ("", SERVICE):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    return False
        except grpc.aio.AioRpcError:
            return False
    return True


async def run_case(case: Case, seed: int, world: World, channels: Channels, token: str,
                   report: FuzzReport) -> None:
    rng = case_rng(seed, case.index)
    try:
        metadata = metadata_for(case.kind, rng, token)
        right = metadata_for("member", rng, token)
        who = await world.join(channels.aio, right) if case.kind == "member" and case.method != "Register" \
            else world.stranger(rng)
        plan = plan_for(case, rng, world, who)
        loop = asyncio.get_running_loop()
        outcome = await asyncio.wait_for(
            loop.run_in_executor(channels.threads, call, channels.blocking, case.method, plan, metadata),
            plan.deadline + 10)
        report.record(case, plan.scenario, outcome)
        if outcome.code == "OK" and plan.on_ok is not None:
            plan.on_ok()
    except asyncio.TimeoutError:
        report.fuzzer_errors += 1
        report.alarm(case, case.scenario, "the call outlived its deadline by 10 s")
    except Exception as exc:  # noqa: BLE001 - a fuzzer bug must not stop the run; it is reported
        report.fuzzer_errors += 1
        report.alarm(case, case.scenario, f"fuzzer error {type(exc).__name__}: {exc}")


@dataclass
class Channels:
    aio: grpc.aio.Channel  # the members' own Registers
    blocking: grpc.Channel  # the fuzz calls (see call())
    threads: ThreadPoolExecutor


async def run_cases(cases: list[Case], seed: int, world: World, address: str, token: str,
                    report: FuzzReport) -> None:
    """All cases, CONCURRENCY at a time; each call's deadline bounds how long it can take."""
    options = [("grpc.max_send_message_length", 64 << 20)]  # so over-limit messages reach the shard
    channels = Channels(grpc.aio.insecure_channel(address), grpc.insecure_channel(address, options=options),
                        ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="fuzz-call"))
    try:
        slots = asyncio.Semaphore(CONCURRENCY)
        running: set[asyncio.Task] = set()
        for case in cases:
            await slots.acquire()
            task = asyncio.ensure_future(run_case(case, seed, world, channels, token, report))
            task.add_done_callback(lambda _t: slots.release())
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)
    finally:
        channels.threads.shutdown(wait=True)
        channels.blocking.close()
        await channels.aio.close()


async def fuzz(cases: int, seed: int, shard, token_file: str, mode: str) -> FuzzReport:
    report = FuzzReport(cases, seed, mode)
    token = read_token(token_file)
    await shard.start()
    try:
        report.exchange_before = await legitimate_round(shard.address, token_file, "before-fuzz")
        await asyncio.sleep(0.5)  # let the warm-up's allocations settle before the baseline
        report.rss_start_kib = report.rss_end_kib = shard.rss_kib()
        report.rss_bound_kib = report.rss_start_kib + RSS_ALLOWANCE_MIB * 1024
        log_start = len(shard.log_lines())
        world = World(seed)
        t0 = time.monotonic()
        with RssSampler(shard) as sampler, HealthWatch(shard.address) as watch:
            await run_cases(make_cases(cases, seed), seed, world, shard.address, token, report)
            report.seconds = time.monotonic() - t0
            await asyncio.sleep(1.0)  # lines the last calls cause, and memory they free
        report.rss_peak_kib, report.rss_quarter_peaks_kib = sampler.peak_kib, sampler.quarter_peaks_kib()
        report.health_worst_s = watch.worst_s
        report.register_failures, report.members_not_joined = world.register_failures, world.not_joined
        report.bad_calls["Register"] += sum(world.register_failures.values())  # failed calls too: they may log
        report.alive = shard.alive()
        if report.alive:
            report.rss_end_kib = shard.rss_kib()
            report.log = analyse_log(shard.log_lines()[log_start:])
            report.serving = await health_serving(shard.address)
            report.exchange_after = await legitimate_round(shard.address, token_file, "after-fuzz")
    finally:
        report.exit_code = await shard.stop()
    return report


def run_fuzz(cases: int, seed: int = 0, subprocess: bool = True, keep_log: str | None = None) -> FuzzReport:
    """Fuzz a fresh shard with ``cases`` calls; the report says what happened and ``problems()``
    lists the properties that did not hold (empty: all did)."""
    with tempfile.TemporaryDirectory(prefix="cgx-ps-fuzz-") as tmp:
        workdir = Path(tmp)
        token_file = new_token_file(workdir)
        shard = (SubprocessShard if subprocess else InProcessShard)(workdir, token_file)
        try:
            return asyncio.run(fuzz(cases, seed, shard, token_file, "subprocess" if subprocess else "in-process"))
        finally:
            if keep_log and shard.log_path.exists():
                Path(keep_log).write_bytes(shard.log_path.read_bytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10_000, help="calls to send (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--subprocess", dest="subprocess", action="store_true", default=True,
                       help="run the shard as its own process (the default: its RSS and log are its own)")
    where.add_argument("--in-process", dest="subprocess", action="store_false",
                       help="run the shard in this process (debugging; RSS includes the fuzzer)")
    parser.add_argument("--keep-log", metavar="FILE", help="copy the shard's log here")
    args = parser.parse_args(argv)
    report = run_fuzz(args.cases, args.seed, subprocess=args.subprocess, keep_log=args.keep_log)
    print(report.summary())
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
