"""What the fuzzer knows of the shard: who a call says it is (Identity), what a call sends
(Plan), the fuzz session (World: its layout, valid payloads, blob keys, fresh members), and
the valid messages the scenarios build on."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import grpc
import torch

from cgx_ps.kernels import Codec, encode
from cgx_ps.model_layout import codec_of, layout_hash
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

from .settings import CALL_DEADLINE_S
from .values import pick_int, pick_text

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
        # the old job's streams close as their cases' calls end (CALL_DEADLINE_S at most): try
        # until then, not a fixed count (under load three tries of 0.1 s ran out while they closed)
        give_up = asyncio.get_running_loop().time() + 2.5 * CALL_DEADLINE_S
        while True:
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
                if asyncio.get_running_loop().time() > give_up:
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
