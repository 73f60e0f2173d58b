"""One node's connection to one shard: Register, then a long-lived Exchange stream.

    client = ShardClient(address, node_id, num_nodes, layout)
    await client.connect()                       # retries with backoff, then a clear error
    result = await client.exchange(block_id, round, payload)   # push, then await the aggregate

Pushes go out as 1 MiB chunks over one stream; results come back on the same stream and are
matched to waiting callers by (block, round). A failed round or a closed stream fails every
waiting call with an error that names the shard and the cause.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc

from .. import __version__, timeline
from ..layout import layout_hash
from ..security import ChannelSecurity
from ..transport import CHUNK_BYTES, chunks
from ..v1 import ps_pb2, ps_pb2_grpc
from .errors import CgxPsError, RoundFailedError, ShardRejectedError, ShardUnavailableError

__all__ = ["ShardClient"]

log = logging.getLogger(__name__)
_PLAIN = ChannelSecurity()  # no token, no TLS (frozen: one shared default is safe)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# Words gRPC puts in the details of a failed TLS handshake: retrying will not fix a certificate.
_TLS_FAILURE_MARKERS = ("handshake", "certificate_verify_failed", "ssl_error", "tls", "certificate")


def connect_failure(address: str, code: grpc.StatusCode, details: str) -> CgxPsError | None:
    """The error that ends connecting to a shard, or None when the failure may pass (retry)."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ShardRejectedError(address, code.name, f"{details} (check CGX_PS_TOKEN_FILE: the shards and "
                                                      f"workers of a job must use the same token)")
    if code == grpc.StatusCode.UNAVAILABLE and any(m in details.lower() for m in _TLS_FAILURE_MARKERS):
        return ShardRejectedError(address, "TLS", f"the TLS handshake failed: {details} (check CGX_PS_TLS_CA, "
                                                  f"CGX_PS_TLS_CERT/KEY and CGX_PS_TLS_SERVER_NAME)")
    if code not in _RETRYABLE:
        return ShardRejectedError(address, code.name, details)
    return None


class ShardClient:
    def __init__(self, address: str, node_id: str, num_nodes: int, layout: ps_pb2.Layout,
                 connect_timeout_s: float = 60.0, job_id: str = "", member: int = 0,
                 security: ChannelSecurity = _PLAIN, incarnation: int = 0) -> None:
        self.address = address
        self.node_id = node_id
        self.num_nodes = num_nodes
        self.layout = layout
        self.layout_hash = layout_hash(layout)
        self.connect_timeout_s = connect_timeout_s
        self.job_id = job_id
        self.member = member
        self.incarnation = incarnation
        self.security = security
        self._metadata = security.metadata()  # the job token, sent with every call
        self.registration: ps_pb2.RegisterResponse | None = None
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._reader: asyncio.Task | None = None
        self._write_lock = asyncio.Lock()
        self._waiting: dict[tuple[int, int], asyncio.Future[bytes]] = {}
        self._incoming: dict[tuple[int, int], list[bytes]] = {}
        self._error: CgxPsError | None = None
        self.bytes_sent = 0
        self.bytes_received = 0

    # ---- setup ----------------------------------------------------------------------------------

    async def connect(self) -> ps_pb2.RegisterResponse:
        self._channel = self.security.aio_channel(self.address)
        stub = ps_pb2_grpc.ParameterServerStub(self._channel)
        request = ps_pb2.RegisterRequest(node_id=self.node_id, num_nodes=self.num_nodes, layout=self.layout,
                                         layout_hash=self.layout_hash, client_version=__version__,
                                         job_id=self.job_id, member=self.member, incarnation=self.incarnation)
        deadline = time.monotonic() + self.connect_timeout_s
        delay = 0.1
        while True:
            try:
                self.registration = await stub.Register(request, timeout=10.0, wait_for_ready=False,
                                                        metadata=self._metadata)
                break
            except grpc.aio.AioRpcError as exc:
                fatal = connect_failure(self.address, exc.code(), exc.details() or "")
                if fatal is not None:
                    raise fatal from None
                if time.monotonic() + delay > deadline:
                    raise ShardUnavailableError(
                        f"shard {self.address} unreachable for {self.connect_timeout_s:g}s "
                        f"(last error: {exc.code().name}: {exc.details()}); check CGX_PS_SERVERS and "
                        f"that the shard is running") from None
                await asyncio.sleep(delay * (0.5 + random.random()))  # jitter: nodes retry apart
                delay = min(delay * 2, 2.0)
        await self._open_stream()
        return self.registration

    async def _open_stream(self) -> None:
        self._call = ps_pb2_grpc.ParameterServerStub(self._channel).Exchange(metadata=self._metadata)
        await self._call.write(ps_pb2.ExchangeRequest(
            hello=ps_pb2.Hello(node_id=self.node_id, layout_hash=self.layout_hash, member=self.member,
                               session_id=self.session_id)))
        self._reader = asyncio.create_task(self._read_results())

    async def reopen(self) -> None:
        """Open a fresh Exchange stream after the old one ended (no new Register, so the
        session and its rounds go on). Results of the old stream that never arrived are lost;
        push those blocks again and the shard resends finished results."""
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
        self._error = None
        self._incoming.clear()
        await self._open_stream()

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        if self._channel is not None:
            await self._channel.close()
        self._fail_all(CgxPsError(f"connection to shard {self.address} closed"))

    @property
    def session_id(self) -> str:
        """The shard session's proof of membership (from Register)."""
        return self.registration.session_id if self.registration is not None else ""

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            raise CgxPsError(f"shard {self.address}: not connected")
        return self._channel

    @property
    def error(self) -> CgxPsError | None:
        """The error that ended this connection's stream (a failed round, a closed shard), if any."""
        return self._error

    # ---- control: adaptive settings, link probe -------------------------------------------------

    async def set_codecs(self, from_round: int, blocks: list[ps_pb2.BlockCodec], resume: bool = False) -> None:
        stub = ps_pb2_grpc.ParameterServerStub(self._channel)
        try:
            await stub.SetCodecs(ps_pb2.SetCodecsRequest(node_id=self.node_id, from_round=from_round, blocks=blocks,
                                                         session_id=self.session_id, resume=resume),
                                 timeout=30, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise ShardRejectedError(self.address, exc.code().name, exc.details() or "") from None

    async def probe(self, nbytes: int) -> float:
        """Seconds to upload nbytes to the shard (1 MiB chunks, as pushes travel)."""
        stub = ps_pb2_grpc.ParameterServerStub(self._channel)
        chunk = ps_pb2.ProbeChunk(data=bytes(min(nbytes, CHUNK_BYTES)))
        count = max(1, nbytes // CHUNK_BYTES)
        t0 = time.perf_counter()
        await stub.Probe(iter([chunk] * count), timeout=120, metadata=self._metadata)
        return time.perf_counter() - t0

    # ---- push / pull ----------------------------------------------------------------------------

    async def exchange(self, block_id: int, round_: int, payload: bytes) -> bytes:
        """Push one block for a round and wait for the aggregate of all nodes."""
        future = self.expect(block_id, round_)
        with timeline.span("push", round_, timeline.block_track(block_id), block=block_id, bytes=len(payload)):
            await self.push(block_id, round_, payload)
        pushed = timeline.mark()
        result = await future
        timeline.pulled(pushed, block_id, round_)
        return result

    def expect(self, block_id: int, round_: int) -> asyncio.Future[bytes]:
        """Register interest in a result before pushing (so an early result is never missed)."""
        if self._error is not None:
            raise self._error
        key = (block_id, round_)
        future = self._waiting.get(key)
        if future is None:
            future = self._waiting[key] = asyncio.get_running_loop().create_future()
        return future

    async def push(self, block_id: int, round_: int, payload: bytes) -> None:
        if self._error is not None:
            raise self._error
        total = len(payload)
        async with self._write_lock:  # one writer at a time; keeps a block's chunks contiguous
            try:
                for off, piece in chunks(payload):
                    chunk = ps_pb2.PushChunk(round=round_, block_id=block_id, total_bytes=total, offset=off,
                                             data=piece)
                    await self._call.write(ps_pb2.ExchangeRequest(push=chunk))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                raise self._error or ShardUnavailableError(
                    f"shard {self.address}: stream closed while pushing: {exc}") from None
        self.bytes_sent += total

    async def _read_results(self) -> None:
        try:
            async for response in self._call:
                kind = response.WhichOneof("kind")
                if kind == "error":
                    e = response.error
                    self._fail_all(RoundFailedError(self.address, e.message, tuple(e.missing_nodes)))
                    continue
                chunk = response.pull
                key = (chunk.block_id, chunk.round)
                if chunk.offset == 0:
                    timeline.note(chunk.block_id, chunk.round)
                parts = self._incoming.setdefault(key, [])
                parts.append(chunk.data)
                if chunk.offset + len(chunk.data) >= chunk.total_bytes:
                    del self._incoming[key]
                    data = parts[0] if len(parts) == 1 else b"".join(parts)
                    self.bytes_received += len(data)
                    future = self._waiting.pop(key, None)
                    if future is None:
                        future = self._waiting[key] = asyncio.get_running_loop().create_future()
                    if not future.done():
                        future.set_result(data)
            self._fail_all(ShardUnavailableError(f"shard {self.address} closed the stream"))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                self._fail_all(CgxPsError(f"connection to shard {self.address} closed"))
            elif exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._fail_all(ShardUnavailableError(f"shard {self.address} went away: {exc.details()}"))
            elif exc.code() == grpc.StatusCode.ABORTED:
                self._fail_all(RoundFailedError(self.address, exc.details() or "aborted"))
            else:
                self._fail_all(ShardRejectedError(self.address, exc.code().name, exc.details() or ""))

    def _fail_all(self, error: CgxPsError) -> None:
        # The first error is the cause (an in-band RoundError comes before the ABORTED status).
        if self._error is None:
            self._error = error
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(self._error)
        self._waiting.clear()
