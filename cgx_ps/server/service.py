"""Where data enters the shard: the gRPC ParameterServer service (Register + Exchange streams).

One Exchange stream per node. Its reader reassembles pushed chunks into block payloads (the size
is checked against the layout before a byte is buffered) and hands each complete block to the
Aggregator as a task, so reading goes on while blocks are summed. Its writer sends the results.
A bad push ends only that node's stream with a status naming the problem; nothing it sent has
touched any accumulator.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

import grpc

from .. import __version__
from ..kernels.wire import HEADER_SIZE
from ..layout import LayoutError, first_difference, layout_hash, validate_layout
from ..transport import chunks
from ..v1 import ps_pb2, ps_pb2_grpc
from .aggregator import Aggregator, RoundFailure
from .blobs import BlobStore, BlobUpload
from .budget import ByteBudget
from .config import ServerConfig
from .errors import (BadRequest, Busy, Conflict, Forbidden, InternalError, LimitExceeded, NotMember, ProtocolError,
                     SessionEnded, ShuttingDown, StreamAborted, TimedOut, shown)
from .metrics import ShardMetrics
from .rpc import grpc_status, read_message

__all__ = ["ParameterServerService"]

log = logging.getLogger(__name__)

_STOP = object()  # queue sentinel: end the node's stream


class _WriterStalled(Exception):
    """The client stopped reading: end its stream with the error set on it."""
MAX_ID_CHARS = 256  # node and job ids: they appear in messages, metrics and gRPC status details
FIRST_MESSAGE_TIMEOUT_S = 30.0  # a stream that opens and says nothing holds a call slot
MAX_PROBE_BYTES = 1 << 30  # auto mode probes with tens of MiB


@dataclass(eq=False)
class _NodeStream:
    node_id: str
    member: int = 0
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    error: ProtocolError | None = None
    queued_bytes: int = 0  # result bytes waiting for this client to read them
    push_tasks: set[asyncio.Task] = field(default_factory=set)  # its pushes still being summed
    stopping: bool = False

    def stop(self, error: ProtocolError | None = None) -> None:
        """End the stream (the writer sends what is queued first), with ``error`` if none yet."""
        self.error = self.error or error
        if not self.stopping:
            self.stopping = True
            self.queue.put_nowait(_STOP)


@dataclass(eq=False)
class _Session:
    layout: ps_pb2.Layout
    layout_hash: str
    num_nodes: int
    aggregator: Aggregator
    job_id: str = ""
    nodes: dict[str, set[int]] = field(default_factory=dict)  # node id -> members registered
    streams: dict[tuple[str, int], _NodeStream] = field(default_factory=dict)
    # streams that pushed each (block, round), so the result goes back exactly there
    pushers: dict[tuple[int, int], list[_NodeStream]] = field(default_factory=dict)
    active: set[tuple[str, int]] = field(default_factory=set)  # members that opened a stream
    last_activity: float = field(default_factory=time.monotonic)
    # result bytes one stream may have waiting: a client reads a block's result before pushing
    # the block's next round, so two rounds of every block (a resend on top) is already generous
    result_cap: int = 0
    ended: str | None = None  # why the session ended (the first reason given)
    # which member of each node pushed each block, and in which round: one local rank per block
    pushed_by: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    # proof of membership, handed out by Register: a stranger cannot act on the session
    session_id: str = field(default_factory=lambda: secrets.token_hex(16))

    def is_member(self, node: str, member: int, session_id: str) -> bool:
        return member in self.nodes.get(node, ()) and secrets.compare_digest(session_id, self.session_id)

    def started(self, node: str, member: int) -> bool:
        """Has this member of a node begun training (so a new Register means it restarted)?"""
        return (node, member) in self.active or node in self.aggregator.pushed_nodes()


class ParameterServerService(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, config: ServerConfig, executor: Executor, metrics: ShardMetrics) -> None:
        self.config = config
        self.executor = executor
        self.metrics = metrics
        self.budget = ByteBudget(config.max_inflight_bytes)
        self.session: _Session | None = None
        self.draining = False
        self.pending_pushes = 0  # blocks being received or summed, not yet in a round's count
        self.blobs = BlobStore(config.max_inflight_bytes)
        # uploads of blobs reserve from their own budget: a stalled or huge PutBlob (it needs no
        # session) can delay other broadcasts, never gradient traffic
        self.blob_budget = ByteBudget(config.max_inflight_bytes)
        self._push_tasks: set[asyncio.Task] = set()
        self._last_ended: _Session | None = None  # its members learn why on their next Hello
        self.instance_id = secrets.token_hex(8)  # a restarted shard is another instance

    def _detail(self, text: str) -> str:
        return shown(text, self.config.authenticates)

    # ---- Register -------------------------------------------------------------------------------

    async def Register(self, request: ps_pb2.RegisterRequest, context: grpc.aio.ServicerContext
                       ) -> ps_pb2.RegisterResponse:
        if self.draining:
            raise ShuttingDown("shard is shutting down")
        node = request.node_id
        if not node:
            raise BadRequest("node_id is empty")
        if len(node) > MAX_ID_CHARS or len(request.job_id) > MAX_ID_CHARS:
            raise BadRequest(f"node_id ({len(node)} chars) and job_id ({len(request.job_id)} chars) must "
                             f"be at most {MAX_ID_CHARS} characters")
        if request.num_nodes < 1:
            raise BadRequest("num_nodes must be >= 1")
        try:
            validate_layout(request.layout)
        except LayoutError as exc:
            raise BadRequest(f"bad layout from {node}: {exc}") from None
        digest = layout_hash(request.layout)
        if digest != request.layout_hash:
            raise BadRequest(f"layout_hash {request.layout_hash[:12]}… does not match the layout "
                             f"sent ({digest[:12]}…): client and server disagree on hashing")
        if request.layout.num_shards != self.config.num_shards:
            raise Conflict(f"layout is sharded for {request.layout.num_shards} shards, this shard "
                           f"was started with --num-shards {self.config.num_shards}")
        too_big = self._memory_refusal(request.layout)
        if too_big is not None:
            raise BadRequest(too_big)
        session = self.session
        busy: list[bool] = []
        if self._starts_new_session(session, request, context_message := [], busy):
            if session is not None:
                self._end_session(session, StreamAborted(context_message[0]))
            session = self._new_session(request, digest)
        elif context_message:
            # busy with another job: the client keeps retrying until it is free
            raise (Busy if busy else Conflict)(context_message[0])
        session.last_activity = time.monotonic()
        session.nodes.setdefault(node, set()).add(request.member)
        session.aggregator.known_nodes.add(node)
        owned = sorted(b.block_id for b in session.layout.blocks if b.shard == self.config.shard_index)
        log.info("node %s registered (%d/%d nodes, %d blocks owned)", node, len(session.nodes),
                 session.num_nodes, len(owned))
        return ps_pb2.RegisterResponse(
            shard_index=self.config.shard_index, num_shards=self.config.num_shards, block_ids=owned,
            next_rounds=[session.aggregator.next_round(b) for b in owned],
            server_version=__version__, round_timeout_s=self.config.round_timeout_s,
            session_id=session.session_id, instance_id=self.instance_id,
        )

    def _memory_refusal(self, layout: ps_pb2.Layout) -> str | None:
        """Why this shard cannot hold a layout's blocks within its memory limits, or None."""
        owned = [b for b in layout.blocks if b.shard == self.config.shard_index]
        largest = max((HEADER_SIZE + 4 * b.numel for b in owned), default=0)
        if largest > self.config.max_inflight_bytes:
            return (f"a block of {largest} bytes (fp32) exceeds this shard's in-flight budget of "
                    f"{self.config.max_inflight_bytes} bytes (--max-inflight-mb): use smaller blocks")
        state = 4 * sum(b.numel for b in owned) * (2 if self.config.error_feedback else 1)
        if state > self.config.max_model_bytes:
            return (f"the layout needs {state} bytes of fp32 state on this shard, more than its "
                    f"--max-model-mb of {self.config.max_model_bytes} bytes: use more shards")
        return None

    def _starts_new_session(self, session: _Session | None, request: ps_pb2.RegisterRequest,
                            message: list[str], busy: list[bool]) -> bool:
        """Decide whether a Register joins the current session, starts a new one (True; message
        says why the old one ends) or is refused (False with a message)."""
        node, job = request.node_id, request.job_id
        if session is None or session.aggregator.failed is not None:
            message.append("session reset after failure")
            return True
        idle = not session.streams and not self.rounds_in_flight()
        if job != session.job_id:
            if idle:
                message.append(f"job {job!r} replaces finished job {session.job_id!r}")
                return True
            which = f" ({session.job_id!r})" if self.config.authenticates else ""  # a stranger must not learn it
            message.append(f"shard is busy with another job{which}, {len(session.streams)} nodes connected; "
                           f"this job must wait or use other shards")
            busy.append(True)
            return False
        diff = first_difference(session.layout, request.layout)
        if request.member in session.nodes.get(node, ()):
            if session.started(node, request.member) or diff is not None:
                # the process restarted, so the job did: start over at round 0
                message.append(f"session reset: node {node} member {request.member} registered again")
                return True
            return False  # a retried Register: idempotent
        if node in session.nodes and diff is None and request.num_nodes == session.num_nodes:
            return False  # another local rank of a known node
        if diff is not None and not job and idle and time.monotonic() - session.last_activity > 10.0:
            message.append("a new job (no job id) replaces an idle session")
            return True
        if diff is not None:
            message.append(f"node {node} declares a different model layout than the session's: {self._detail(diff)}")
        elif request.num_nodes != session.num_nodes:
            message.append(f"node {node} says num_nodes={request.num_nodes}, the session has {session.num_nodes}")
        elif len(session.nodes) >= session.num_nodes:
            message.append(f"node {node} would be node {len(session.nodes) + 1} of a session of "
                           f"{session.num_nodes} nodes: {sorted(session.nodes)}")
        return False

    def _new_session(self, request: ps_pb2.RegisterRequest, digest: str) -> _Session:
        owned = [b for b in request.layout.blocks if b.shard == self.config.shard_index]
        holder: list[_Session] = []
        aggregator = Aggregator(
            owned, request.num_nodes, self.executor,
            on_result=lambda block, rnd, data: self._broadcast(holder[0], block, rnd, data),
            on_failure=lambda failure: self._on_failure(holder[0], failure),
            round_timeout_s=self.config.round_timeout_s,
            error_feedback=self.config.error_feedback, metrics=self.metrics,
        )
        layout = ps_pb2.Layout()
        layout.CopyFrom(request.layout)
        session = _Session(layout, digest, request.num_nodes, aggregator, job_id=request.job_id,
                           result_cap=2 * sum(HEADER_SIZE + 4 * b.numel for b in owned) + (1 << 20))
        holder.append(session)
        self.session = session
        self.blobs.clear()  # a new session starts with no blobs: none from another job or run
        log.info("new session: %d tensors, %d blocks (%d here), %d nodes, layout %s",
                 len(layout.tensors), len(layout.blocks), len(owned), request.num_nodes, digest[:12])
        return session

    def _end_session(self, session: _Session, error: ProtocolError) -> None:
        session.aggregator.close()
        # a member registered there but not yet streaming learns why its session is gone (the
        # first reason: "reset after failure" must not hide the failure itself)
        session.ended = session.ended or error.message
        self._last_ended = session
        if session is self.session:
            self.blobs.clear()
        for stream in session.streams.values():
            stream.stop(error)

    # ---- results and failures -------------------------------------------------------------------

    def _broadcast(self, session: _Session, block_id: int, round_: int, data: bytes) -> None:
        """Send a result to the stream of every node that pushed it (one per node)."""
        messages = _pull_messages(block_id, round_, data)
        streams = session.pushers.pop((block_id, round_), [])
        for stream in streams:
            self._send(session, stream, messages, len(data))
        self.metrics.bytes_out.inc(len(data) * len(streams))

    def _send(self, session: _Session, stream: _NodeStream, messages: list, nbytes: int) -> None:
        """Queue messages for a stream's writer, unless its client has stopped reading: one client
        that never reads must not grow the shard's memory without bound."""
        if stream.queued_bytes + nbytes > session.result_cap:
            stream.stop(LimitExceeded(f"node {stream.node_id} member {stream.member} is not reading its results "
                                      f"({stream.queued_bytes} bytes waiting)"))
            return
        stream.queued_bytes += nbytes
        stream.queue.put_nowait((messages, nbytes))

    def _on_failure(self, session: _Session, failure: RoundFailure) -> None:
        error = ps_pb2.ExchangeResponse(error=ps_pb2.RoundError(
            round=failure.round, block_id=failure.block_id, message=failure.message,
            missing_nodes=list(failure.missing_nodes)))
        for stream in session.streams.values():
            stream.queue.put_nowait(([error], 0))
        self._end_session(session, StreamAborted(failure.message))

    # ---- Exchange -------------------------------------------------------------------------------

    async def Exchange(self, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        first = await _first_message(context, ps_pb2.ExchangeRequest)
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "hello":
            raise BadRequest("the first message must be a Hello")
        node, member, session = first.hello.node_id, first.hello.member, self.session
        if session is None or not session.is_member(node, member, first.hello.session_id):
            last = self._last_ended
            ended = self._detail(last.ended) if last is not None and member in last.nodes.get(node, ()) else None
            raise NotMember(f"node {node!r} member {member}: its session ended ({ended}); register again"
                            if ended else f"node {node!r} has not registered with this shard (push before Register)")
        if first.hello.layout_hash != session.layout_hash:
            raise Conflict(f"node {node}: layout hash {first.hello.layout_hash[:12]}… is not the "
                           f"session's {session.layout_hash[:12]}… (register again)")
        if session.aggregator.failed is not None:
            raise SessionEnded(f"session failed: {session.aggregator.failed.message}")
        stream = _NodeStream(node, member)
        old = session.streams.get((node, member))
        if old is not None:  # a reconnect replaces the old stream, also for results still due
            old.stop(StreamAborted(f"replaced by a newer stream of node {node} member {member} (a reconnect)"))
            for waiting in session.pushers.values():
                waiting[:] = [stream if s is old else s for s in waiting]
        session.streams[(node, member)] = stream
        session.active.add((node, member))
        session.last_activity = time.monotonic()
        self.metrics.connected_nodes.inc()
        reader = asyncio.create_task(self._read_pushes(context, session, stream))
        try:
            while True:
                item = await stream.queue.get()
                if item is _STOP:
                    break
                messages, nbytes = item
                for message in messages:
                    try:  # gRPC flow control holds a write until the client reads
                        await asyncio.wait_for(context.write(message), self.config.round_timeout_s)
                    except asyncio.TimeoutError:
                        stream.error = stream.error or LimitExceeded(
                            f"node {node} member {member} has not read its results for "
                            f"{self.config.round_timeout_s:g}s ({stream.queued_bytes} bytes waiting)")
                        log.warning("node %s member %d stopped reading: %s", node, member, stream.error.message)
                        raise _WriterStalled from None
                stream.queued_bytes -= nbytes
        except _WriterStalled:
            while not stream.queue.empty():  # the client will never read these: free them now
                stream.queue.get_nowait()
            stream.queued_bytes = 0
        finally:
            reader.cancel()
            self.metrics.connected_nodes.dec()
            if session.streams.get((node, member)) is stream:
                del session.streams[(node, member)]
            session.last_activity = time.monotonic()
        if stream.error is not None:
            await context.abort(*grpc_status(stream.error))

    async def _read_pushes(self, context: grpc.aio.ServicerContext, session: _Session,
                           stream: _NodeStream) -> None:
        partial: dict[int, _Assembly] = {}
        cancelled = False
        try:
            while True:
                request = await self._next_push(context, stream, partial)
                if request is grpc.aio.EOF:
                    break
                if request.WhichOneof("kind") != "push":
                    raise BadRequest("expected a PushChunk after Hello")
                chunk = request.push
                payload = await self._assemble(session, partial, chunk)
                if payload is not None:
                    # Summed in its own task so this stream keeps reading. Never cancelled: a
                    # push that has been read is always summed and its budget released.
                    task = asyncio.create_task(self._push(session, stream, chunk, payload))
                    for tasks in (self._push_tasks, stream.push_tasks):
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
        except asyncio.CancelledError:
            cancelled = True  # the writer is gone: nothing more can reach this client
            raise
        except ProtocolError as exc:
            stream.error = stream.error or exc  # the first cause (say, "replaced by a newer stream") stands
            self.metrics.push(stream.node_id, "rejected")
            log.warning("node %s: %s", stream.node_id, exc.message)
        except grpc.aio.AioRpcError:
            pass  # the client went away; nothing to tell it
        except Exception as exc:  # noqa: BLE001 - never leave the writer waiting forever
            log.exception("node %s: unexpected error reading pushes", stream.node_id)
            stream.error = stream.error or InternalError(f"shard error: {exc!r}")
        finally:
            for assembly in partial.values():
                self.budget.release(assembly.total)
                self.pending_pushes -= 1
            self._update_inflight()
            if stream.push_tasks and not cancelled:
                # results of pushes already read (say, the one completing a round while the shard
                # drains) go out before the stream ends: the client's gradient is in them
                await asyncio.wait(set(stream.push_tasks))
            # EOF, error or cancellation: end the stream (on EOF pending results are not awaited:
            # a client half-closes only when it has everything it waits for)
            stream.stop()

    async def _next_push(self, context: grpc.aio.ServicerContext, stream: _NodeStream,
                         partial: dict[int, _Assembly]):
        """The next message; a client that stops halfway through a block's chunks holds part of
        the shard's memory budget, so it gets the round timeout to continue, not forever."""
        if not partial:
            return await read_message(context, ps_pb2.ExchangeRequest)
        # A block's upload has one deadline in total, not per chunk: a client trickling one byte
        # per chunk must not hold the block's memory forever.
        (block_id, a), = partial.items()
        left = a.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(read_message(context, ps_pb2.ExchangeRequest), max(left, 0.0))
        except asyncio.TimeoutError:
            raise TimedOut(f"sent {a.filled} of {a.total} bytes of block {block_id} round {a.round} "
                           f"in {self.config.round_timeout_s:g}s; a block must arrive whole within the "
                           f"round timeout") from None

    async def _assemble(self, session: _Session, partial: dict[int, _Assembly],
                        chunk: ps_pb2.PushChunk) -> bytes | None:
        """Add a chunk to its block; return the payload once complete."""
        if session.aggregator.failed is not None or session is not self.session:
            raise SessionEnded("session is no longer active")
        if self.draining and session.aggregator.next_round(chunk.block_id) == chunk.round and not \
                session.aggregator.blocks[chunk.block_id].pushed:
            raise ShuttingDown("shard is shutting down; no new rounds")
        assembly = partial.get(chunk.block_id)
        if assembly is None and partial:
            # a block's chunks come contiguously (the client holds its stream for a whole block), so
            # a stream holds at most one block's reservation while it waits for budget: no deadlock
            (other, a), = partial.items()
            raise BadRequest(f"block {chunk.block_id}: chunk arrived while block {other} has {a.filled} of "
                             f"{a.total} bytes; a stream must send one block's chunks contiguously")
        if assembly is None:
            sizes = session.aggregator.allowed_sizes(chunk.block_id, chunk.round)  # rejects unknown ids
            if chunk.total_bytes not in sizes:
                raise BadRequest(f"block {chunk.block_id}: push of {chunk.total_bytes} bytes, the layout "
                                 f"says {sizes[0]} (or {sizes[1]} uncompressed)")
            expected = chunk.total_bytes
            # Reserve the whole block up front: a block holds all of its budget or none, so
            # streams that each hold part of the budget can never wait on each other forever.
            try:
                await asyncio.wait_for(self.budget.acquire(expected), 2 * self.config.round_timeout_s)
            except asyncio.TimeoutError:
                raise LimitExceeded(f"block {chunk.block_id}: the shard's memory budget ({self.budget.capacity} "
                                    f"bytes) stayed full for {2 * self.config.round_timeout_s:g}s") from None
            assembly = partial[chunk.block_id] = _Assembly(chunk.round, expected,
                                                           deadline=time.monotonic() + self.config.round_timeout_s)
            self.pending_pushes += 1
            self._update_inflight()
        if chunk.round != assembly.round or chunk.total_bytes != assembly.total or chunk.offset != assembly.filled:
            raise BadRequest(f"block {chunk.block_id}: chunk (round {chunk.round}, offset {chunk.offset}, "
                             f"total {chunk.total_bytes}) does not continue round {assembly.round} at "
                             f"offset {assembly.filled} of {assembly.total}")
        n = len(chunk.data)
        if n == 0 or assembly.filled + n > assembly.total:
            raise BadRequest(f"block {chunk.block_id}: chunk of {n} bytes at offset {chunk.offset} "
                             f"overruns the block's {assembly.total} bytes")
        assembly.add(chunk.data)
        if assembly.filled < assembly.total:
            return None
        del partial[chunk.block_id]
        return assembly.payload()

    async def _push(self, session: _Session, stream: _NodeStream, chunk: ps_pb2.PushChunk,
                    payload: bytes) -> None:
        key = (chunk.block_id, chunk.round)
        pushers = session.pushers.setdefault(key, [])
        pushers.append(stream)  # before push(): the last push completes the round inside it
        claim_key, by, claim = (chunk.block_id, stream.node_id), None, None

        def forget() -> None:
            if stream in pushers:
                pushers.remove(stream)
            if not pushers and session.pushers.get(key) is pushers:
                del session.pushers[key]

        try:
            by = session.pushed_by.get(claim_key)
            if by is not None and by[0] == chunk.round and by[1] != stream.member:
                raise BadRequest(f"block {chunk.block_id} round {chunk.round} was already pushed by member "
                                 f"{by[1]} of node {stream.node_id}: one local rank pushes each block")
            # claimed before the first await, so two members racing cannot both get past the check
            session.pushed_by[claim_key] = claim = (chunk.round, stream.member)
            outcome = await session.aggregator.push(stream.node_id, chunk.block_id, chunk.round, payload)
            if not outcome.accepted and outcome.resend is None:
                # a retry of a push already summed, its round still open: the result is due to this
                # stream alone (the one that pushed first may be gone, replaced by a reconnect)
                pushers[:] = [s for s in pushers if (s.node_id, s.member) != (stream.node_id, stream.member)]
                pushers.append(stream)
            elif not outcome.accepted:
                forget()  # the round is over: the result goes back with the resend below
        except Exception as exc:  # noqa: BLE001 - any failure ends this node's stream, clearly
            forget()
            if claim is not None and session.pushed_by.get(claim_key) == claim:
                if by is None:  # our push did not count: another member may still push the block
                    del session.pushed_by[claim_key]
                else:
                    session.pushed_by[claim_key] = by
            if not isinstance(exc, ProtocolError):
                log.exception("node %s: unexpected error in push", stream.node_id)
                exc = InternalError(f"shard error: {exc!r}")
            self.metrics.push(stream.node_id, "rejected")
            log.warning("node %s: %s", stream.node_id, exc.message)
            stream.stop(exc)
            return
        finally:
            self.budget.release(len(payload))
            self.pending_pushes -= 1
            self._update_inflight()
        self.metrics.push(stream.node_id, "accepted" if outcome.accepted else "duplicate")
        if outcome.resend is not None:
            self._send(session, stream, _pull_messages(chunk.block_id, chunk.round, outcome.resend),
                       len(outcome.resend))

    def _update_inflight(self) -> None:
        self.metrics.inflight_bytes.set(self.budget.used)

    # ---- blobs (broadcasts) ---------------------------------------------------------------------

    def _member_refusal(self, node: str, member: int, session_id: str) -> str | None:
        """Why a caller may not touch the session's blobs or settings, or None for a member."""
        session = self.session
        if session is None or not session.is_member(node, member, session_id):
            return (f"node {node[:MAX_ID_CHARS]!r} member {member} is not a member of this shard's current "
                    f"session (register first; a session's blobs and settings are its members' alone)")
        return None

    async def PutBlob(self, context: grpc.aio.ServicerContext) -> ps_pb2.PutBlobResponse:
        first = await _first_message(context, ps_pb2.BlobChunk)
        if first is grpc.aio.EOF:
            raise BadRequest("PutBlob stream carried no chunk")
        refusal = self._member_refusal(first.node_id, first.member, first.session_id)
        if refusal is not None:
            raise Forbidden(refusal)
        session, key, total = self.session, first.key, first.total_bytes
        self.blobs.admit(key, total)

        async def next_chunk() -> ps_pb2.BlobChunk | None:
            chunk = await read_message(context, ps_pb2.BlobChunk)
            return None if chunk is grpc.aio.EOF else chunk

        # bounded memory for concurrent puts: a stalled or huge PutBlob can delay other
        # broadcasts, never gradient traffic
        await self.blob_budget.acquire(total)
        try:
            data = await BlobUpload(key, total, self.config.round_timeout_s).receive(first, next_chunk)
            if session is not self.session:
                raise SessionEnded("the session ended during the upload")
            self.blobs.put(key, data, writer=(first.node_id, first.member))
        finally:
            self.blob_budget.release(total)
        return ps_pb2.PutBlobResponse()

    async def GetBlob(self, request: ps_pb2.GetBlobRequest, context: grpc.aio.ServicerContext) -> None:
        session = self.session
        if session is None or not secrets.compare_digest(request.session_id, session.session_id):
            raise Forbidden("not a member of this shard's current session (register first)")
        data, (node, member) = await self.blobs.get(request.key, request.timeout_s or 60.0)
        for off, piece in chunks(data):
            await context.write(ps_pb2.BlobChunk(key=request.key, total_bytes=len(data), offset=off, data=piece,
                                                 node_id=node, member=member))

    # ---- adaptive compression and link probe -----------------------------------------------------

    async def SetCodecs(self, request: ps_pb2.SetCodecsRequest, context: grpc.aio.ServicerContext
                        ) -> ps_pb2.SetCodecsResponse:
        session = self.session
        if session is None or request.node_id not in session.nodes or \
                not secrets.compare_digest(request.session_id, session.session_id):
            raise NotMember(f"node {request.node_id[:MAX_ID_CHARS]!r} is not a member of this shard's "
                            f"current session (register first)")
        mine = [(b.block_id, b.codec) for b in request.blocks if b.block_id in session.aggregator.blocks]
        session.aggregator.set_codecs(request.from_round, mine)
        if mine:
            log.info("codec settings of %d blocks change from round %d (by %s)", len(mine), request.from_round,
                     request.node_id)
        return ps_pb2.SetCodecsResponse()

    async def Probe(self, context: grpc.aio.ServicerContext) -> ps_pb2.ProbeResponse:
        total = 0
        chunk = await _first_message(context, ps_pb2.ProbeChunk)
        while chunk is not grpc.aio.EOF:  # read and dropped: memory stays one chunk
            total += len(chunk.data)
            if total > MAX_PROBE_BYTES:
                raise BadRequest(f"a link probe sends at most {MAX_PROBE_BYTES} bytes")
            chunk = await asyncio.wait_for(read_message(context, ps_pb2.ProbeChunk), self.config.round_timeout_s)
        return ps_pb2.ProbeResponse(bytes=total)

    # ---- shutdown -------------------------------------------------------------------------------

    def rounds_in_flight(self) -> int:
        session = self.session
        in_rounds = 0 if session is None else session.aggregator.rounds_in_flight()
        return in_rounds + self.pending_pushes

    def close_streams(self, reason: str) -> None:
        if self.session is not None:
            self._end_session(self.session, ShuttingDown(reason))


@dataclass(eq=False)
class _Assembly:
    round: int
    total: int  # also the bytes reserved in the budget for it
    deadline: float = math.inf  # time.monotonic() by which the last chunk must have arrived
    filled: int = 0
    parts: list[bytes] = field(default_factory=list)

    def add(self, data: bytes) -> None:
        self.parts.append(data)
        self.filled += len(data)

    def payload(self) -> bytes:
        # One chunk: no copy. Several: one join (cheaper than growing a bytearray chunk by chunk).
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)


async def _first_message(context: grpc.aio.ServicerContext, cls: type):
    """A stream's first message, which must come soon: an idle stream holds a call slot."""
    try:
        return await asyncio.wait_for(read_message(context, cls), FIRST_MESSAGE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise TimedOut(f"no first message within {FIRST_MESSAGE_TIMEOUT_S:g}s of opening the stream") from None


def _pull_messages(block_id: int, round_: int, data: bytes) -> list[ps_pb2.ExchangeResponse]:
    """Chunk one result into messages built once and written to every node's stream."""
    return [ps_pb2.ExchangeResponse(pull=ps_pb2.PullChunk(round=round_, block_id=block_id, total_bytes=len(data),
                                                          offset=off, data=piece))
            for off, piece in chunks(data)]
