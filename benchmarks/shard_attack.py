"""A registered member that attacks a shard at its caps: it fills the blob store, the upload and
in-flight budgets and parks streams on them, so ``shard_memory.py`` can read what the shard
then holds (the "attack" and "worst" scenarios)."""

from __future__ import annotations

import asyncio
import os

import grpc

from benchmarks.memshard import MiB, run, settle, shown, start_shard
from cgx_ps.kernels import HEADER_SIZE
from cgx_ps.model_layout import layout_hash
from cgx_ps.net.security import ChannelSecurity
from cgx_ps.net.channel_options import CHUNK_BYTES
from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

__all__ = ["PARKED_CHUNK", "PARKED_STREAMS", "Attacker", "attack"]


class Attacker:
    """A registered member of the shard's session (it holds the token and a session id)."""

    def __init__(self, address: str, security: ChannelSecurity, inflight_mb: int, parts: int = 8) -> None:
        self.address, self.security = address, security
        self.cap = inflight_mb * MiB
        # blocks sized so `parts` partial ones fill the in-flight budget (fp32 pushes: the largest allowed)
        numel = (self.cap // parts - HEADER_SIZE) // 4
        self.layout = build_layout([TensorInfo("w", (numel * parts,))], 1, Compression(bits=None),
                                   block_bytes=numel * 4)
        self.block_total = HEADER_SIZE + 4 * numel
        self.parts = parts
        self.calls: list = []
        self.channel: grpc.aio.Channel | None = None
        self.session_id = ""
        self.md = security.metadata()
        self.chunk = os.urandom(CHUNK_BYTES)

    async def register(self, members: int) -> None:
        self.channel = self.security.aio_channel(self.address)
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)
        for m in range(members):
            r = await self.stub.Register(ps_pb2.RegisterRequest(
                node_id="node-0", num_nodes=1, layout=self.layout, layout_hash=layout_hash(self.layout),
                member=m), metadata=self.md, timeout=30)
            self.session_id = r.session_id

    async def _send(self, call, make, total: int, upto: int) -> None:
        off = 0
        while off < upto:
            n = min(CHUNK_BYTES, upto - off)
            await call.write(make(off, self.chunk if n == CHUNK_BYTES else self.chunk[:n]))
            off += n

    async def blobs(self, count: int, size: int, prefix: str, finish: bool) -> None:
        """``count`` PutBlobs of ``size`` bytes: completed, or left one byte short (held open)."""
        for i in range(count):
            key = f"{prefix}/{i}"
            call = self.stub.PutBlob(metadata=self.md)
            make = lambda off, data, key=key: ps_pb2.BlobChunk(  # noqa: E731
                key=key, total_bytes=size, offset=off, data=data, node_id="node-0", member=0,
                session_id=self.session_id)
            await self._send(call, make, size, size if finish else size - 1)
            if finish:
                await call.done_writing()
                await call
            else:
                self.calls.append(call)

    async def _hello(self, member: int):
        call = self.stub.Exchange(metadata=self.md)
        await call.write(ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(
            node_id="node-0", layout_hash=layout_hash(self.layout), member=member, session_id=self.session_id)))
        self.calls.append(call)
        return call

    async def partial_blocks(self, first_member: int) -> None:
        """One stream per block, each sending all of the block's fp32 push but one byte."""
        for i in range(self.parts):
            call = await self._hello(first_member + i)
            make = lambda off, data, i=i: ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(  # noqa: E731
                round=0, block_id=i, total_bytes=self.block_total, offset=off, data=data))
            await self._send(call, make, self.block_total, self.block_total - 1)

    async def parked(self, first_member: int, count: int, chunk_bytes: int) -> None:
        """Streams whose first chunk waits for budget (the shard holds that chunk meanwhile). A
        chunk may be as large as a gRPC message (8 MiB), not only CHUNK_BYTES."""
        data = os.urandom(min(chunk_bytes, self.block_total))
        for j in range(count):
            call = await self._hello(first_member + j)
            msg = ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(round=0, block_id=j % self.parts,
                                                               total_bytes=self.block_total, offset=0,
                                                               data=data))
            await asyncio.wait_for(call.write(msg), 10)

    async def close(self) -> None:
        for call in self.calls:
            call.cancel()
        if self.channel is not None:
            await self.channel.close()


PARKED_STREAMS = 32
PARKED_CHUNK = 7 * MiB  # under the 8 MiB gRPC message limit (cgx_ps.net.channel_options.GRPC_OPTIONS)


def attack(tmp: str, token: str, inflight_mb: int, worst: bool, parked: int = PARKED_STREAMS) -> dict:
    shard = start_shard(tmp, token, inflight_mb, extra=("--round-timeout", "600"))
    stages: list[tuple[str, dict]] = []

    async def go() -> None:
        att = Attacker(shard.address, ChannelSecurity(token_file=token), inflight_mb)
        members = att.parts * 2 + parked
        try:
            await att.register(members)
            stages.append(("registered", await asyncio.to_thread(settle, shard.pid)))
            blob = att.cap // 8 - 16  # cost = key (<= 16 bytes) + data: 8 fill the capacity
            if not worst:
                await att.blobs(1, att.cap - 16, "full", finish=True)  # one blob: its chunks and their join coexist
                stages.append(("+ blob store full (one blob of M)", await asyncio.to_thread(settle, shard.pid)))
                await att.partial_blocks(0)
                stages.append(("+ partial blocks fill in-flight budget (M)", await asyncio.to_thread(settle, shard.pid)))
            else:
                await att.blobs(7, blob, "full", finish=True)
                stages.append(("+ 7/8 of blob store", await asyncio.to_thread(settle, shard.pid)))
                # uploads reserve their size from the same capacity as stored blobs: one more fills it
                await att.blobs(1, blob, "open", finish=False)
                stages.append(("+ an unfinished PutBlob fills the rest of the store",
                               await asyncio.to_thread(settle, shard.pid)))
                await att.partial_blocks(0)
                stages.append(("+ partial blocks fill in-flight budget (M)", await asyncio.to_thread(settle, shard.pid)))
                await att.parked(att.parts, parked, PARKED_CHUNK)
                stages.append((f"+ {parked} streams parked on the budget, each with a {PARKED_CHUNK / MiB:g} MiB chunk",
                               await asyncio.to_thread(settle, shard.pid)))
            if shard.proc.poll() is not None:
                raise RuntimeError("the shard died during the attack")
        finally:
            await att.close()  # its channel, before run()'s loop is left

    try:
        run(go())
    finally:
        shard.stop()
    return {"stages": stages, "cmd": shown(shard.cmd)}
