"""One node's connection to one shard: Register, then a long-lived Exchange stream, kept alive.

    client = ShardClient(address, node_id, num_nodes, layout, recovery_timeout_s=60)
    await client.connect()                       # retries with backoff, then a clear error
    result = await client.exchange(block_id, round, payload)   # push, then await the aggregate

Pushes go out as 1 MiB chunks over one stream, serialized by hand (net/chunk_frames.py; a payload may
come framed already: ``PushFrames``, made on the worker's codec thread); results come
back on the same stream, read by hand too (``read_result``: the data a view of the received bytes,
not two protobuf copies), and are matched to waiting callers by (block, round).

Recovery (recovery.py decides, supervisor.py acts). A push is kept until its result arrives, and
so is the last result of each block. When the stream breaks (the shard died, is restarting, or
the connection dropped), a supervisor task reconnects with backoff. The same shard instance
kept the session: reopen a stream and push the unanswered blocks again (duplicates are
harmless there). A restarted instance lost it: register again as a resuming node, give back
the last results (``restore``) and push the unanswered blocks again, under the same round
numbers. Callers waiting for results notice nothing. They fail, with an error naming the shard,
when it is not back within ``recovery_timeout_s`` (0: at once), when a round failed for
everyone, on a refusal, and when a push stays unanswered past the shard's round timeout on a
connection that looks healthy (a stopped or hung shard).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence, TypeVar

import grpc

from ... import __version__, timeline
from ...net.addresses import bare_host
from ...model_layout import layout_hash
from ...net.security import ChannelSecurity, read_token
from ...kernels.wire import max_encoded_size
from ...net.chunk_frames import PULL_FIELD, PUSH_FIELD, ChunkFrame, PushFrames, chunk_frames, read_chunk
from ...net.channel_options import CHUNK_BYTES
from ...v1 import ps_pb2, ps_pb2_grpc
from ..config import dataplane_problem
from .raw_call import RawCall, decide_dataplane, falls_back_to_grpc
from ..errors import CgxPsError, ConfigError, RoundFailedError, ShardRejectedError, ShardUnavailableError
from .recovery import Fail, Recover, after_stream_end, broke_under_write, closed_while_connecting, connect_failure
from .tls_probe import closed_connection_cause
from .supervisor import ConnectionSupervisor

__all__ = ["Payload", "Result", "ShardClient", "push_frames", "read_result"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
Result = bytes | memoryview  # a block's aggregate: a view of the message it came in, or its chunks joined
Payload = bytes | PushFrames  # a block's push: its bytes, or framed already (by the codec thread)
# while a worker waits for a shard at start: how often it says so (a silent wait looks like a hang)
_WAITING_NOTE_S = 15.0
_PLAIN = ChannelSecurity()  # no token, no TLS (frozen: one shared default is safe)

# What writing to a stream that has ended raises (the status itself comes to the reader).
_WRITE_ERRORS = (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError)
# the method path the generated stub calls, from the .proto
_EXCHANGE = f"/{ps_pb2.DESCRIPTOR.services_by_name['ParameterServer'].full_name}/Exchange"


def read_result(raw: bytes) -> ChunkFrame | ps_pb2.ExchangeResponse:
    """The Exchange stream's response deserializer: a result chunk as our shards send it, read
    without protobuf (``chunkframes.read_chunk``); anything else (a RoundError) parsed by protobuf,
    which raises for bytes it refuses, as the generated stub's deserializer does."""
    frame = read_chunk(raw, PULL_FIELD)
    return frame if frame is not None else ps_pb2.ExchangeResponse.FromString(raw)


def push_frames(block_id: int, round_: int, payload: Payload) -> Sequence[bytes]:
    """The frames that push ``payload`` for a block and round: as it came framed, else framed here."""
    return payload.frames if isinstance(payload, PushFrames) else chunk_frames(PUSH_FIELD, block_id, round_, payload)


def _mislabelled(block_id: int, round_: int, payload: Payload) -> CgxPsError | None:
    """Why ``payload`` may not be pushed as ``block_id``'s for ``round_``; None if it may. Frames
    name their block and round: pushed under another key, the shard would count them for the
    block they name while this client waited for another."""
    if isinstance(payload, PushFrames) and (payload.block_id, payload.round) != (block_id, round_):
        return CgxPsError(f"frames of block {payload.block_id} round {payload.round} pushed as block "
                          f"{block_id} round {round_}")
    return None


@dataclass(eq=False)
class _Unanswered:
    payload: Payload
    since: float  # time.monotonic() of its last (re)push: the hung-shard deadline counts from here


class ShardClient(ConnectionSupervisor):
    def __init__(self, address: str, node_id: str, num_nodes: int, layout: ps_pb2.Layout,
                 connect_timeout_s: float = 60.0, job_id: str = "", member: int = 0,
                 security: ChannelSecurity = _PLAIN, incarnation: int = 0,
                 recovery_timeout_s: float = 0.0, dataplane: str = "auto") -> None:
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
        self.recovery_timeout_s = recovery_timeout_s  # how long to wait for a lost shard; 0: fail at once
        self._metadata = security.metadata()  # the job token, sent with every call
        # the same token for the raw data plane's streams: both planes authenticate alike (re-read
        # per stream, a token file gone later would fail the raw plane's repairs only)
        self._token = read_token(security.token_file).encode() if security.token_file else b""
        # the Exchange stream's transport (worker/shards/raw_call.py): CGX_PS_DATAPLANE, and what the
        # last registration decided with it
        self.dataplane = dataplane
        problem = dataplane_problem(dataplane, security.tls)
        if problem is not None:
            raise ConfigError(problem)
        self._dataplane_warned = False
        self._data_port = 0  # the shard's raw data plane, while the stream takes it (until the next Register)
        self._just_registered = False  # no stream opened since the shard answered Register (falls_back_to_grpc)
        self.registration: ps_pb2.RegisterResponse | None = None
        self._channel: grpc.aio.Channel | None = None
        self._connect_deadline = 0.0  # time.monotonic() by which connecting must have worked
        self._call = None
        self._reader: asyncio.Task | None = None
        self._write_lock = asyncio.Lock()
        self._waiting: dict[tuple[int, int], asyncio.Future[Result]] = {}
        # results arriving in chunks: (block, round) -> (their total_bytes, the chunks so far)
        self._incoming: dict[tuple[int, int], tuple[int, list[Result]]] = {}
        # a result is at most its block's largest encoding: a shard cannot make us hold more
        self._max_result = {b.block_id: max_encoded_size(b.numel) for b in layout.blocks}
        self._error: CgxPsError | None = None
        # told of the error that ends this connection (not of a close we asked for): the engine
        # ends the job's exchanges on the other shards with it (CommEngine._one_shard_failed)
        self.on_error: Callable[["ShardClient", CgxPsError], None] | None = None
        # recovery: what a new stream must carry, and the state of the current one
        self._unanswered: dict[tuple[int, int], _Unanswered] = {}  # pushed, no result yet; oldest first
        self._results: dict[int, tuple[int, Result]] = {}  # block -> (round, its result): for restores
        self._generation = 0  # of the current stream: the end of an older one is old news
        self._ready = asyncio.Event()  # the current stream is open and carries every unanswered push
        self._broken = asyncio.Event()  # the current stream ended in a way recovery may repair
        self._break_cause = ""
        self._supervisor: asyncio.Task | None = None
        self._closing = False
        self.recoveries = 0  # streams repaired
        self.recovery_s = 0.0  # total seconds spent repairing them
        self.bytes_sent = 0
        self.bytes_received = 0

    # ---- setup ----------------------------------------------------------------------------------

    async def identify(self) -> ps_pb2.StatusResponse:
        """Which shard this address is (its Status), asked before registering anywhere: a worker
        that lists the shards out of order learns it while no shard holds a session for it
        (registered, it would leave an idle session behind on every shard it reached). Retries
        as ``connect`` does, within the same ``connect_timeout_s``."""
        self._open_channel()
        return await self._until_answered(lambda: self._stub().Status(
            ps_pb2.StatusRequest(), timeout=10.0, wait_for_ready=False, metadata=self._metadata))

    async def connect(self) -> ps_pb2.RegisterResponse:
        self._open_channel()
        await self._until_answered(lambda: self._register(resume=False, timeout=10.0))
        async with self._write_lock:
            try:
                await self._open_stream()
            except grpc.aio.AioRpcError as exc:  # CGX_PS_DATAPLANE=raw, and its port cannot be reached
                raise ShardUnavailableError(f"shard {self.address}: {exc.details()} (CGX_PS_DATAPLANE=raw)") from None
        self._supervise()
        return self.registration

    def _open_channel(self) -> None:
        """The channel to the shard, and the deadline of connecting through it (set once: asking
        for the shard's index first does not extend the wait for it)."""
        if self._channel is None:
            self._channel = self.security.aio_channel(self.address)
            self._connect_deadline = time.monotonic() + self.connect_timeout_s

    async def _until_answered(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """``call``'s answer, retried with backoff while the shard cannot be reached (or is busy
        with another job) until the connect deadline; a refusal raises at once."""
        deadline = self._connect_deadline
        delay = 0.1
        probed = False
        say_at = time.monotonic()  # when to say next that we still wait: at the first failure, then every so often
        while True:
            try:
                return await call()
            except grpc.aio.AioRpcError as exc:
                fatal = connect_failure(self.address, exc.code(), exc.details() or "", self.security.tls)
                if fatal is None and not probed and closed_while_connecting(exc.code(), exc.details() or ""):
                    probed = True  # once: a TLS mismatch does not change between attempts
                    cause = await asyncio.to_thread(closed_connection_cause, self.address, self.security)
                    fatal = ShardRejectedError(self.address, "TLS", cause) if cause else None
                if fatal is not None:
                    raise fatal from None
                now = time.monotonic()
                if now + delay <= deadline and now >= say_at:  # a worker waiting in silence looks hung
                    log.warning("shard %s not reachable yet (%s); retrying for up to %.0fs more "
                                "(CGX_PS_CONNECT_TIMEOUT)", self.address, _brief(exc), deadline - now)
                    say_at = now + _WAITING_NOTE_S
                if now + delay > deadline:
                    raise ShardUnavailableError(
                        f"shard {self.address} unreachable for {self.connect_timeout_s:g}s "
                        f"(last error: {exc.code().name}: {exc.details()}); check CGX_PS_SERVERS and "
                        f"that the shard is running") from None
                await asyncio.sleep(delay * (0.5 + random.random()))  # jitter: nodes retry apart
                delay = min(delay * 2, 2.0)

    async def _register(self, resume: bool, timeout: float) -> None:
        # Rejoining, present the incarnation the shard counted for our start (admission.py), the
        # same for every member of it: our launcher's count may differ from our peers'.
        incarnation = self.registration.incarnation if resume else self.incarnation
        request = ps_pb2.RegisterRequest(node_id=self.node_id, num_nodes=self.num_nodes, layout=self.layout,
                                         layout_hash=self.layout_hash, client_version=__version__,
                                         job_id=self.job_id, member=self.member, resume=resume,
                                         incarnation=incarnation)
        self.registration = await self._stub().Register(request, timeout=timeout, wait_for_ready=False,
                                                        metadata=self._metadata)
        # a restarted shard may listen on another data port, or none
        choice = decide_dataplane(self.dataplane, self.registration.data_port, self.security.tls, self.address)
        if choice.warning and not self._dataplane_warned:
            self._dataplane_warned = True
            log.warning("%s", choice.warning)
        self._data_port = self.registration.data_port if choice.plane == "raw" else 0
        self._just_registered = True

    def _stub(self) -> ps_pb2_grpc.ParameterServerStub:
        return ps_pb2_grpc.ParameterServerStub(self._channel)

    def _exchange_call(self):
        """An Exchange stream that takes serialized requests (pushes are framed by hand:
        net/chunk_frames.py) and reads result chunks by hand (``read_result``)."""
        method = self._channel.stream_stream(_EXCHANGE, request_serializer=None, response_deserializer=read_result)
        return method(metadata=self._metadata)

    async def _open_stream(self) -> None:
        """A new Exchange stream (call with the write lock held); ready once the caller has pushed
        what must go first."""
        self._generation += 1
        self._incoming.clear()
        self._call = call = await self._open_call()
        await call.write(ps_pb2.ExchangeRequest(
            hello=ps_pb2.Hello(node_id=self.node_id, layout_hash=self.layout_hash, member=self.member,
                               session_id=self.session_id)).SerializeToString())
        self._reader = asyncio.create_task(self._read_results(call, self._generation))
        self._ready.set()

    async def _open_call(self):
        """The Exchange call: over the shard's raw data plane when chosen and reachable, else gRPC.
        Under auto, a data port that cannot be reached right after Register (a NetworkPolicy
        without the port, a port-forward of the gRPC port alone; on a first connect or a rejoin of a
        restarted shard, with its new port) sends the stream to gRPC with one warning, until the
        shard next answers Register; otherwise a failure is the shard's (raised: UNAVAILABLE,
        which recovery retries). falls_back_to_grpc decides."""
        just_registered, self._just_registered = self._just_registered, False
        if self._data_port:
            host = bare_host(self.address.rsplit(":", 1)[0])
            try:
                return await RawCall.open(host, self._data_port, self._token, read_result)
            except grpc.aio.AioRpcError as exc:
                if not falls_back_to_grpc(self.dataplane, just_registered):
                    raise
                log.warning("shard %s: its data port %d cannot be reached (%s): the Exchange stream goes over gRPC "
                            "(set CGX_PS_DATAPLANE=grpc to skip the attempt, or open the port)", self.address,
                            self._data_port, exc.details())
                self._data_port = 0
        return self._exchange_call()

    def _drop_stream(self) -> None:
        """Forget the current stream: its reader's end is old news from now on."""
        self._generation += 1
        self._ready.clear()
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()

    async def reopen(self) -> None:
        """Open a fresh Exchange stream after the old one ended (no new Register, so the
        session and its rounds go on), even after an error ended the old one. Results of the old
        stream that never arrived are lost; push those blocks again and the shard resends
        finished results."""
        self._drop_stream()
        self._error = None
        async with self._write_lock:
            await self._open_stream()
        self._supervise()

    async def close(self) -> None:
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        self._drop_stream()
        if self._reader is not None:
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
        """The error that ended this connection for good (a failed round, a shard not back in
        time, a refusal), if any; a connection being repaired has none."""
        return self._error

    # ---- control: adaptive settings, link probe -------------------------------------------------

    async def set_codecs(self, from_round: int, blocks: list[ps_pb2.BlockCodec], resume: bool = False) -> None:
        """Announce blocks' settings from a round on; ``resume``: they start there (a checkpoint).
        (A shard that restarts in between learns the settings from the pushes themselves.)"""
        def announce():  # made anew for a retry: a rejoin changed the session id
            request = ps_pb2.SetCodecsRequest(node_id=self.node_id, from_round=from_round, blocks=blocks,
                                              session_id=self.session_id, resume=resume)
            return self._stub().SetCodecs(request, timeout=30, metadata=self._metadata)

        await self._control("SetCodecs", announce)

    async def probe(self, nbytes: int) -> float:
        """Seconds to upload nbytes to the shard (1 MiB chunks, as pushes travel)."""
        chunk = ps_pb2.ProbeChunk(data=bytes(min(nbytes, CHUNK_BYTES)))
        count = max(1, nbytes // CHUNK_BYTES)

        async def timed() -> float:
            t0 = time.perf_counter()
            await self._stub().Probe(iter([chunk] * count), timeout=120, metadata=self._metadata)
            return time.perf_counter() - t0

        return await self._control("Probe", timed)

    async def _control(self, what: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """A control call through recovery: made on a ready connection, and made once more when
        the shard went away under it, after the supervisor repaired the connection."""
        for attempt in range(2):
            await self._wait_ready()
            channel, generation = self._channel, self._generation  # the connection this attempt uses
            try:
                return await call()
            except asyncio.CancelledError:
                if self._channel is channel or attempt:
                    raise  # we are being cancelled
                # the supervisor closed the channel under the call to reconnect: the shard went away
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or ""
                gone = code == grpc.StatusCode.UNAVAILABLE or broke_under_write(code, details)
                if not gone:
                    raise ShardRejectedError(self.address, code.name, details) from None
                if attempt or self.recovery_timeout_s <= 0:  # gone, and not back: not a refusal
                    raise ShardUnavailableError(f"shard {self.address} went away during {what}: {code.name}: "
                                                f"{details}") from None
                # Only the connection the call used is broken: if the supervisor already replaced
                # it (the stream's reader saw the shard go first), the next attempt waits for that.
                self._stream_broke(generation, f"{what}: {code.name}: {details}")
        raise AssertionError("unreachable: the second attempt returns or raises")

    # ---- push / pull ----------------------------------------------------------------------------

    async def exchange(self, block_id: int, round_: int, payload: Payload) -> Result:
        """Push one block for a round and wait for the aggregate of all nodes (a view of the
        received message when it came in one chunk: ``read_result``)."""
        mislabelled = _mislabelled(block_id, round_, payload)
        if mislabelled is not None:  # refused before expect(): no future is left waiting for it
            raise mislabelled
        future = self.expect(block_id, round_)
        with timeline.span("push", round_, timeline.block_track(block_id), block=block_id, bytes=len(payload)):
            await self.push(block_id, round_, payload)
        pushed = timeline.mark()
        result = await future
        timeline.pulled(pushed, block_id, round_)
        return result

    def expect(self, block_id: int, round_: int) -> asyncio.Future[Result]:
        """Register interest in a result before pushing (so an early result is never missed)."""
        if self._error is not None:
            raise self._error
        key = (block_id, round_)
        future = self._waiting.get(key)
        if future is None:
            future = self._waiting[key] = asyncio.get_running_loop().create_future()
        return future

    async def push(self, block_id: int, round_: int, payload: Payload) -> None:
        """Send a block's payload for a round; kept until its result arrives. While the stream is
        being repaired it is only kept: the repair pushes it."""
        if self._error is not None:
            raise self._error
        mislabelled = _mislabelled(block_id, round_, payload)
        if mislabelled is not None:
            raise mislabelled
        async with self._write_lock:  # one writer at a time; keeps a block's chunks contiguous
            # kept under the lock: a repair pushes it exactly when this call does not
            self._unanswered[(block_id, round_)] = _Unanswered(payload, time.monotonic())
            if self._ready.is_set():
                generation = self._generation  # a repair may drop this stream under the write
                try:
                    await self._write(block_id, round_, payload)
                except _WRITE_ERRORS as exc:
                    self._stream_broke(generation, f"stream closed while pushing: {_brief(exc)}")
        self.bytes_sent += len(payload)

    async def _write(self, block_id: int, round_: int, payload: Payload, restore: bool = False) -> None:
        frames = chunk_frames(PUSH_FIELD, block_id, round_, payload, True) if restore else \
            push_frames(block_id, round_, payload)
        for frame in frames:
            await self._call.write(frame)

    async def _read_results(self, call, generation: int) -> None:
        code, details = None, ""
        try:
            async for response in call:
                if isinstance(response, ChunkFrame):
                    self._take(response)
                    continue
                if response.WhichOneof("kind") == "error":
                    e = response.error
                    self._fail_all(RoundFailedError(self.address, e.message, tuple(e.missing_nodes)))
                    continue
                self._take(response.pull)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
        except _MalformedResult as exc:  # a broken or hostile shard: nothing it sends next can be trusted
            if generation == self._generation:
                self._fail_all(CgxPsError(f"shard {self.address} sent a malformed result: {exc}; the shard is broken "
                                          f"or not a cgx-ps shard of this version"))
                self._drop_stream()
            return
        if generation != self._generation:
            return  # a stream we replaced or dropped
        match after_stream_end(code, details, self._closing):
            case None:
                self._fail_all(CgxPsError(f"connection to shard {self.address} closed"))
            case Recover(cause):
                self._stream_broke(generation, cause)
            case Fail(code, details) if code == grpc.StatusCode.ABORTED:
                self._fail_all(RoundFailedError(self.address, details or "aborted"))
            case Fail(code, details):
                self._fail_all(ShardRejectedError(self.address, code.name, details))

    def _take(self, chunk: ChunkFrame | ps_pb2.PullChunk) -> None:
        key = (chunk.block_id, chunk.round)
        total, parts = self._incoming.get(key, (None, []))
        if total is None and key not in self._waiting and key not in self._unanswered:
            return  # a result nobody waits for (a second copy after a repair): not kept
        problem = result_chunk_problem(chunk, sum(len(p) for p in parts), total,
                                       self._max_result.get(chunk.block_id))
        if problem is not None:
            raise _MalformedResult(f"block {chunk.block_id} round {chunk.round}: {problem}")
        if chunk.offset == 0:
            timeline.note(chunk.block_id, chunk.round)
        parts.append(chunk.data)
        if chunk.offset + len(chunk.data) < chunk.total_bytes:
            self._incoming[key] = (chunk.total_bytes, parts)
            return
        self._incoming.pop(key, None)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.bytes_received += len(data)
        pushed = self._unanswered.pop(key, None) is not None
        if self.recovery_timeout_s > 0 and chunk.round >= self._results.get(chunk.block_id, (-1, b""))[0]:
            self._results[chunk.block_id] = (chunk.round, data)
        future = self._waiting.pop(key, None)
        if future is None and pushed:  # pushed without expect(): an early result is kept for it
            future = self._waiting[key] = asyncio.get_running_loop().create_future()
        if future is not None and not future.done():  # else: a second copy after a repair
            future.set_result(data)

    def abandon(self, error: CgxPsError) -> None:
        """End every exchange waiting on this shard with ``error``, which ended the job elsewhere
        (another shard's connection): their rounds wait for nodes that stop now."""
        self._fail_all(error)

    def _fail_all(self, error: CgxPsError) -> None:
        # The first error is the cause (an in-band RoundError comes before the ABORTED status).
        if self._error is None:
            self._error = error
            if self.on_error is not None and not self._closing:
                self.on_error(self, error)
        self._ready.clear()
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(self._error)
        self._waiting.clear()
        self._unanswered.clear()
        self._results.clear()
        self._incoming.clear()  # partial results of a connection that is over


class _MalformedResult(Exception):
    """A result chunk that breaks the protocol (result_chunk_problem says how)."""


def result_chunk_problem(chunk: ChunkFrame | ps_pb2.PullChunk, received: int, total: int | None,
                         limit: int | None) -> str | None:
    """Why a result chunk cannot continue the result under way for its (block, round), or None.
    ``received``: the bytes of that result taken so far; ``total``: its first chunk's total_bytes
    (None: this chunk is the first); ``limit``: the block's largest encoding (None: no such block).
    A shard sends a result's chunks in order, each non-empty unless the result is (frames.py), so
    anything else would make the worker hold more than a block, or join a result from pieces."""
    if limit is None:
        return "no such block in the layout"
    if chunk.total_bytes > limit:
        return f"{chunk.total_bytes} bytes, more than any encoding of the block ({limit})"
    if total is not None and chunk.total_bytes != total:
        return f"its size changed from {total} to {chunk.total_bytes} bytes between chunks"
    if chunk.offset != received:
        return f"a chunk at offset {chunk.offset}, where {received} bytes had come"
    if chunk.offset + len(chunk.data) > chunk.total_bytes:
        return f"a chunk past the result's {chunk.total_bytes} bytes"
    if not len(chunk.data) and chunk.total_bytes:
        return "an empty chunk of a result that is not"
    return None


def _brief(exc: Exception) -> str:
    """One line for the log: an RPC error's status, not its multi-line repr."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
