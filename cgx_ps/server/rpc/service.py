"""Where data enters the shard: the gRPC ParameterServer service, mapping each call to the
session (session.py), the blob store (blobs.py) or the codec schedule (aggregator.py).

    Register   checks and admission (admission.py): join, restart or refuse
    Exchange   one stream per member: its pushes are reassembled (reassembly.py) and each whole
               block is summed in a task of its own, so reading goes on; results go out through
               the member's NodeStream (stream.py)
    PutBlob, GetBlob, SetCodecs, Probe

A bad push ends only that member's stream, with the status errors.py and rpc.STATUS_CODES give
it; nothing it sent has touched any accumulator. Every call comes through a ``StreamContext``
(stream_context.py): an Exchange stream from the gRPC port or the raw data plane is served by the
same code.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from concurrent.futures import Executor

import grpc

from ... import __version__
from ...net.channel_options import chunks
from ...v1 import ps_pb2, ps_pb2_grpc
from ..session.admission import MAX_ID_CHARS, Refuse, Restart, admit, check_registration, session_incarnation
from ..session.blobs import BlobStore, BlobUpload
from ..rounds.budget import ByteBudget
from ..config import ServerConfig
from ..errors import (BadRequest, Conflict, Forbidden, InternalError, LimitExceeded, NotMember, ProtocolError,
                      SessionEnded, ShuttingDown, StreamAborted, TimedOut, shown, without_tracebacks)
from .push_frames import PushFrame, read_push
from ..metrics import ShardMetrics
from ..rounds.reassembly import InflightPushes, PushAssembler
from ...rate_limited_log import RateLimitedLog
from .gate import discard_rest, grpc_status, read_message
from ..session.job_session import Session
from ..session.outbound import NodeStream
from .stream_context import EOF, StreamContext, StreamEnded

__all__ = ["ParameterServerService"]

log = logging.getLogger(__name__)

FIRST_MESSAGE_TIMEOUT_S = 30.0  # a stream that opens and says nothing holds a call slot
MAX_PROBE_BYTES = 1 << 30  # auto mode probes with tens of MiB


class ParameterServerService(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, config: ServerConfig, executor: Executor, metrics: ShardMetrics) -> None:
        self.config = config
        self.executor = executor
        self.metrics = metrics
        self.session: Session | None = None
        self.draining = False
        self.inflight = InflightPushes(config.max_inflight_bytes, metrics.inflight_bytes)
        self.blobs = BlobStore(config.max_inflight_bytes)
        self._push_tasks: set[asyncio.Task] = set()  # holds them: the event loop keeps tasks weakly
        self._last_ended: Session | None = None  # replaced or shut down last: its members learn why
        self.instance_id = secrets.token_hex(8)  # a restarted shard is another instance
        self.data_port = 0  # the raw data plane's port, advertised at Register; 0: none (ShardServer sets it)
        # a network that drops every node at once must not write a line per stream per second
        self.lost_log = RateLimitedLog(log)

    @property
    def budget(self) -> ByteBudget:
        """Bytes of pushed blocks held (being received or summed)."""
        return self.inflight.budget

    @property
    def pending_pushes(self) -> int:
        """Blocks being received or summed, not yet in a round's count."""
        return self.inflight.count

    # ---- Register -------------------------------------------------------------------------------

    async def Register(self, request: ps_pb2.RegisterRequest, context: StreamContext
                       ) -> ps_pb2.RegisterResponse:
        digest = check_registration(request, self.config)
        match admit(self.session, request, in_flight=self.rounds_in_flight(), now=time.monotonic(),
                    authenticated=self.config.authenticates):
            case Refuse(error):
                raise error
            case Restart(reason):
                self._start_session(request, digest, reason)
        session = self.session
        session.join(request.node_id, request.member)
        owned = sorted(session.aggregator.blocks)
        log.info("node %s registered (%d/%d nodes, %d blocks owned)", request.node_id, len(session.nodes),
                 session.num_nodes, len(owned))
        return ps_pb2.RegisterResponse(
            shard_index=self.config.shard_index, num_shards=self.config.num_shards, block_ids=owned,
            next_rounds=[session.aggregator.next_round(b) for b in owned],
            server_version=__version__, round_timeout_s=self.config.round_timeout_s,
            session_id=session.session_id, instance_id=self.instance_id, incarnation=session.incarnation,
            data_port=self.data_port,
        )

    def _start_session(self, request: ps_pb2.RegisterRequest, digest: str, reason: str) -> None:
        incarnation = session_incarnation(self.session, request)
        if self.session is not None:
            self.session.end(StreamAborted(reason))
            self._last_ended = self.session
        self.blobs.clear()  # a new session starts with no blobs: none from another job or run
        self.session = session = Session(request, digest, self.config, self.executor, self.blobs, self.metrics,
                                         incarnation=incarnation)
        log.info("new %ssession: %d tensors, %d blocks (%d here), %d nodes, layout %s",
                 "resumed " if session.resumed else "", len(session.layout.tensors),
                 len(session.layout.blocks), len(session.aggregator.blocks), session.num_nodes, digest[:12])

    # ---- Exchange -------------------------------------------------------------------------------

    async def Exchange(self, context: StreamContext) -> None:  # noqa: N802
        """One node's stream, from the gRPC port or the raw data plane (``context.plane``)."""
        first = await _first_message(context, ps_pb2.ExchangeRequest)
        if first is EOF or first.WhichOneof("kind") != "hello":
            raise BadRequest("the first message must be a Hello")
        session = self._session_of(first.hello)
        stream = session.open_stream(first.hello.node_id, first.hello.member)
        self.metrics.connected_nodes.inc()
        self.metrics.exchange_streams[context.plane].inc()
        reader = asyncio.create_task(self._read_pushes(context, session, stream))
        try:
            await stream.write_results(context.write, self.config.round_timeout_s)
        finally:
            reader.cancel()
            self.metrics.connected_nodes.dec()
            self.metrics.exchange_streams[context.plane].dec()
            session.close_stream(stream)
        if stream.error is not None:
            await context.abort(*grpc_status(stream.error))

    def _session_of(self, hello: ps_pb2.Hello) -> Session:
        """The session a Hello may open a stream in; raises why not."""
        node, member, session = hello.node_id, hello.member, self.session
        if session is None or not session.is_member(node, member, hello.session_id):
            # its members learn why their session ended: the one replaced last, or this one
            last = session if session is not None and session.ended is not None else self._last_ended
            if last is not None and member in last.nodes.get(node, ()):
                raise NotMember(f"node {node!r} member {member}: its session ended "
                                f"({shown(last.ended, self.config.authenticates)}); register again")
            raise NotMember(f"node {node!r} has not registered with this shard (push before Register)")
        if hello.layout_hash != session.layout_hash:
            raise Conflict(f"node {node}: layout hash {hello.layout_hash[:12]}… is not the "
                           f"session's {session.layout_hash[:12]}… (register again)")
        if session.failed is not None:
            raise SessionEnded(f"session failed: {session.failed.message}")
        return session

    async def _read_pushes(self, context: StreamContext, session: Session, stream: NodeStream) -> None:
        assembler = PushAssembler(self.inflight, self.config.round_timeout_s,
                                  track=f"{stream.node_id}/{stream.member} receive")
        cancelled = False
        try:
            while await self._read_push(context, session, stream, assembler):
                pass
        except asyncio.CancelledError:
            cancelled = True  # the writer is gone: nothing more can reach this client
            raise
        except ProtocolError as exc:
            stream.fail(self._rejected(stream, exc))  # the first cause ("replaced by a newer stream") stands
        except (grpc.aio.AbortError, StreamEnded):
            pass  # the call has ended with its status (the stream's writer aborted it): nothing to read or tell
        except ConnectionError as exc:
            # the client is gone and the context's read noticed first (stream_context.py: on the
            # raw data plane, every way a peer goes is one ConnectionResetError): an event of the
            # network, not of the shard, and nothing can reach the client any more. (Not OSError:
            # a TimeoutError is one.)
            self.lost_log.warning("lost:Exchange", "node %s: %s lost: %s", stream.node_id, context.lost_as,
                                  exc.strerror or exc)
        except Exception as exc:  # noqa: BLE001 - never leave the writer waiting forever
            log.exception("node %s: unexpected error reading pushes", stream.node_id)
            stream.fail(InternalError(f"shard error: {exc!r}"))
        finally:
            assembler.abandon()
            if stream.push_tasks and not cancelled:
                # results of pushes already read (say, the one completing a round while the shard
                # drains) go out before the stream ends: the client's gradient is in them
                await asyncio.wait(set(stream.push_tasks))
            # EOF, error or cancellation: end the stream (on EOF pending results are not awaited:
            # a client half-closes only when it has everything it waits for)
            stream.stop()

    async def _read_push(self, context: StreamContext, session: Session, stream: NodeStream,
                         assembler: PushAssembler) -> bool:
        """Read the stream's next message and act on it; False at the stream's end.

        A call of its own per message, so that what it read is let go when it returns: the
        message (up to the 8 MiB gRPC admits) and the block it completed, once that block's push
        task is done with it. Held by the reading loop instead, they lived until the stream's
        next message, which may come a whole step later: per idle stream up to a block and a
        message outside the push budget, whose bytes the push task had already given back."""
        raw = await assembler.next_message(context.read)
        if raw is EOF:
            return False
        chunk = read_push(raw)
        self._check_push(session, chunk)
        payload = await assembler.add(chunk, session.aggregator.allowed_sizes) if chunk.has_data else b""
        if payload is not None:
            # Summed in its own task so this stream keeps reading. Never cancelled: a push that
            # has been read is always summed and its budget released.
            task = asyncio.create_task(self._push(session, stream, chunk, payload))
            for tasks in (self._push_tasks, stream.push_tasks):
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        return True

    def _rejected(self, stream: NodeStream, error: ProtocolError) -> ProtocolError:
        """Count and log a refused push; the error, without the tracebacks (its own and those it
        chains) that would keep the stream's frames (and the pushed bytes) alive."""
        self.metrics.push(stream.node_id, "rejected")
        log.warning("node %s: %s", stream.node_id, error.message)
        return without_tracebacks(error)

    def _check_push(self, session: Session, chunk: PushFrame) -> None:
        if session.failed is not None or session is not self.session:
            raise SessionEnded("session is no longer active")
        if self.draining and session.aggregator.opens_round(chunk.block_id, chunk.round):
            raise ShuttingDown("shard is shutting down; no new rounds")

    async def _push(self, session: Session, stream: NodeStream, chunk: PushFrame, payload: bytes | memoryview
                    ) -> None:
        try:
            # a restored result (recovery after a shard restart, ps.proto PushChunk.restore), a late
            # node's fetch of a round's result (quorum rounds, PushChunk.fetch) or a push
            aggregator = session.aggregator
            if chunk.fetch:
                outcome = await aggregator.fetch(stream.node_id, stream.member, chunk.block_id, chunk.round)
            elif chunk.out_of_data:  # uneven inputs: the node has left the rounds (rounds/uneven.py)
                outcome = await aggregator.out_of_data(stream.node_id, stream.member, chunk.block_id, chunk.round)
            else:
                act = aggregator.restore if chunk.restore else aggregator.push
                outcome = await act(stream.node_id, stream.member, chunk.block_id, chunk.round, payload)
        except Exception as exc:  # noqa: BLE001 - any failure ends this member's stream, clearly
            if not isinstance(exc, ProtocolError):
                log.exception("node %s: unexpected error in push", stream.node_id)
                exc = InternalError(f"shard error: {exc!r}")
            stream.stop(self._rejected(stream, exc))
            return
        finally:
            if chunk.has_data:  # a fetch or an out-of-data push took no push budget (assembler.add)
                self.inflight.release(len(payload))
        if chunk.has_data and session.aggregator.rule.active:
            said = session.late.note(stream.node_id, outcome.late_next is not None)
            if said:
                log.warning("%s", said)
        if outcome.late_next is not None:  # told at once, before the round's result
            self.metrics.push(stream.node_id, "late")
            stream.send_control(ps_pb2.ExchangeResponse(late=ps_pb2.LateNotice(
                round=chunk.round, block_id=chunk.block_id, next_round=outcome.late_next)))
        elif chunk.has_data:  # a fetch or an out-of-data push is not a gradient's push
            self.metrics.push(stream.node_id, "accepted" if outcome.accepted else "duplicate")
        if outcome.resend is not None:  # a retry of the round just finished (its result again), a late push
            stream.send(outcome.resend.frames, len(outcome.resend), chunk.block_id, chunk.round)

    # ---- blobs (broadcasts) ---------------------------------------------------------------------

    def _blob_writer(self, node: str, member: int, session_id: str) -> Session:
        """The session whose blobs a caller may write: a member's alone."""
        session = self.session
        if session is None or not session.is_member(node, member, session_id):
            raise Forbidden(f"node {node[:MAX_ID_CHARS]!r} member {member} is not a member of this shard's current "
                            f"session (register first; a session's blobs and settings are its members' alone)")
        return session

    async def PutBlob(self, context: StreamContext) -> ps_pb2.PutBlobResponse:
        first = await _first_message(context, ps_pb2.BlobChunk)
        if first is EOF:
            raise BadRequest("PutBlob stream carried no chunk")
        refused = await self._put_blob_or_refusal(first, context)
        del first  # up to one message: nothing of the upload is held while the rest is drained
        if refused is None:
            return ps_pb2.PutBlobResponse()
        if not isinstance(refused, TimedOut):  # TimedOut: the upload's time is up, no waiting for the rest
            # Refused while the client may still be writing the blob: let it finish first, so it
            # hears why (a broadcast that does not fit the store), not INTERNAL. Outside any
            # except block, so what the call holds meanwhile is one raw message at a time, for
            # at most round_timeout_s (rpc.discard_rest), not the upload's buffer.
            await discard_rest(context, self.config.round_timeout_s)
        raise refused

    async def _put_blob_or_refusal(self, first: ps_pb2.BlobChunk, context: StreamContext
                                   ) -> ProtocolError | None:
        """Store the blob, or say why not. The refusal comes without its traceback: that would
        keep the frames of the failed upload, and so its buffer (up to the store's capacity,
        already given back to the store's accounting), alive for as long as the refusal lives."""
        try:
            await self._put_blob(first, context)
            return None
        except ProtocolError as exc:
            return without_tracebacks(exc)

    async def _put_blob(self, first: ps_pb2.BlobChunk, context: StreamContext) -> None:
        session = self._blob_writer(first.node_id, first.member, first.session_id)

        async def next_chunk() -> ps_pb2.BlobChunk | None:
            chunk = await read_message(context, ps_pb2.BlobChunk)
            return None if chunk is EOF else chunk

        # Room in the store first (refused when full: uploads and stored blobs share one
        # capacity, so blobs never hold more than it, and gradient traffic never waits on them).
        reserved = self.blobs.reserve(first.key, first.total_bytes)
        try:
            upload = BlobUpload(first.key, first.total_bytes, self.config.round_timeout_s)
            data = await upload.receive(first, next_chunk)
            if session is not self.session:
                raise SessionEnded("the session ended during the upload")
            self.blobs.put(upload.key, data, writer=(first.node_id, first.member), reserved=reserved)
            reserved = 0
        finally:
            self.blobs.release(reserved)

    async def GetBlob(self, request: ps_pb2.GetBlobRequest, context: StreamContext) -> None:
        if self.session is None or not self.session.proves(request.session_id):
            raise Forbidden("not a member of this shard's current session (register first)")
        data, (node, member) = await self.blobs.get(request.key, request.timeout_s or 60.0)
        for off, piece in chunks(data):
            # Bounded as a result stream's writes are (stream.py): a client that stops reading
            # would otherwise keep the blob alive after the store dropped it (a new session),
            # outside the store's capacity, for as long as it stays connected.
            try:
                await asyncio.wait_for(context.write(ps_pb2.BlobChunk(
                    key=request.key, total_bytes=len(data), offset=off, data=piece, node_id=node, member=member)),
                    self.config.round_timeout_s)
            except asyncio.TimeoutError:
                raise LimitExceeded(f"blob {request.key[:64]!r}: the client has not read it for "
                                    f"{self.config.round_timeout_s:g}s ({off} of {len(data)} bytes sent)") from None

    # ---- adaptive compression and link probe -----------------------------------------------------

    async def SetCodecs(self, request: ps_pb2.SetCodecsRequest, context: StreamContext
                        ) -> ps_pb2.SetCodecsResponse:
        session = self.session
        if session is None or request.node_id not in session.nodes or not session.proves(request.session_id):
            raise NotMember(f"node {request.node_id[:MAX_ID_CHARS]!r} is not a member of this shard's "
                            f"current session (register first)")
        if len(request.blocks) > len(session.layout.blocks) or \
                len({b.block_id for b in request.blocks}) != len(request.blocks):
            # bounded work on the event loop: one entry per block of the layout, at most
            raise BadRequest(f"SetCodecs lists {len(request.blocks)} entries for a layout of "
                             f"{len(session.layout.blocks)} blocks; each block at most once")
        mine = [(b.block_id, b.codec) for b in request.blocks if b.block_id in session.aggregator.blocks]
        if request.resume:
            session.aggregator.resume(request.from_round, mine)
            if mine:
                log.info("%d blocks resume at round %d (by %s)", len(mine), request.from_round, request.node_id)
            return ps_pb2.SetCodecsResponse()
        session.aggregator.set_codecs(request.from_round, mine)
        if mine:
            log.info("codec settings of %d blocks change from round %d (by %s)", len(mine), request.from_round,
                     request.node_id)
        return ps_pb2.SetCodecsResponse()

    async def Probe(self, context: StreamContext) -> ps_pb2.ProbeResponse:
        total = 0
        chunk = await _first_message(context, ps_pb2.ProbeChunk)
        while chunk is not EOF:  # read and dropped: memory stays one chunk
            total += len(chunk.data)
            if total > MAX_PROBE_BYTES:
                raise BadRequest(f"a link probe sends at most {MAX_PROBE_BYTES} bytes")
            try:
                chunk = await asyncio.wait_for(read_message(context, ps_pb2.ProbeChunk), self.config.round_timeout_s)
            except asyncio.TimeoutError:
                raise TimedOut(f"the link probe paused for {self.config.round_timeout_s:g}s") from None
        return ps_pb2.ProbeResponse(bytes=total)

    # ---- shutdown -------------------------------------------------------------------------------

    def rounds_in_flight(self) -> int:
        session = self.session
        in_rounds = 0 if session is None else session.aggregator.rounds_in_flight()
        return in_rounds + self.inflight.count

    def close_streams(self, reason: str) -> None:
        if self.session is not None:
            self.session.end(ShuttingDown(reason))
            self._last_ended = self.session


async def _first_message(context: StreamContext, cls: type):
    """A stream's first message, which must come soon: an idle stream holds a call slot."""
    try:
        return await asyncio.wait_for(read_message(context, cls), FIRST_MESSAGE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise TimedOut(f"no first message within {FIRST_MESSAGE_TIMEOUT_S:g}s of opening the stream") from None
