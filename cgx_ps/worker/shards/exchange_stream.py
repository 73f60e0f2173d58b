"""One node's pushes to one shard and the results that answer them, over whichever Exchange
stream currently carries them (an ``ExchangeCall``: exchange_call.py).

Pushes go out as 1 MiB chunks, serialized by hand (net/chunk_frames.py; a payload may come framed
already: ``PushFrames``, made on the worker's codec thread); results come back on the same
stream and are matched to waiting callers by (block, round). A push is kept until its result
arrives, and so is the last result of each block (``keep_results``), so that a repaired stream
can carry them again: ``attach`` a new call, and the supervisor (supervisor.py) asks it to restore
those results to a restarted shard and to push the unanswered blocks again. Each attached call
is a generation: the end of an older one is old news.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ... import timeline
from ...kernels.wire import max_encoded_size
from ...net.chunk_frames import PUSH_FIELD, ChunkFrame, PushFrames, chunk_frames
from ...v1 import ps_pb2
from ..errors import CgxPsError, RoundFailedError, ShardRejectedError, StreamEnded
from .exchange_call import ExchangeCall
from .recovery import Fail, Recover, after_stream_end

__all__ = ["ExchangeStream", "Payload", "Result", "push_frames", "result_chunk_problem"]

Result = bytes | memoryview  # a block's aggregate: a view of the message it came in, or its chunks joined
Payload = bytes | PushFrames  # a block's push: its bytes, or framed already (by the codec thread)


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


class ExchangeStream:
    """The pushes and results of one shard connection; ``address`` names the shard in errors,
    ``layout`` bounds each result's size, ``keep_results``: keep each block's last result (for a
    restore after the shard restarted: recovery is on). ``on_error`` is told of the error that
    ends the exchange (not of a close we asked for)."""

    def __init__(self, address: str, layout: ps_pb2.Layout, keep_results: bool) -> None:
        self.address = address
        self.keep_results = keep_results
        self.on_error: Callable[[CgxPsError], None] | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        # the current call, and what reads it
        self._call: ExchangeCall | None = None
        self._reader: asyncio.Task | None = None
        self._generation = 0  # of the current call: the end of an older one is old news
        self._write_lock = asyncio.Lock()  # one writer at a time: a block's chunks stay contiguous
        self._ready = asyncio.Event()  # the current call is open and carries every unanswered push
        self._broken = asyncio.Event()  # the current call ended in a way a repair may mend
        self._break_cause = ""
        self._error: CgxPsError | None = None
        self._closing = False
        # the exchanges: who waits, what is under way, what a repair must carry again
        self._waiting: dict[tuple[int, int], asyncio.Future[Result]] = {}
        # results arriving in chunks: (block, round) -> (their total_bytes, the chunks so far)
        self._incoming: dict[tuple[int, int], tuple[int, list[Result]]] = {}
        self._unanswered: dict[tuple[int, int], _Unanswered] = {}  # pushed, no result yet; oldest first
        self._results: dict[int, tuple[int, Result]] = {}  # block -> (round, its result): for restores
        # quorum rounds: block -> the round it was at when the shard told us we were late (LateNotice)
        self.late: dict[int, int] = {}
        # a result is at most its block's largest encoding: a shard cannot make us hold more
        self._max_result = {b.block_id: max_encoded_size(b.numel) for b in layout.blocks}

    # ---- state ----------------------------------------------------------------------------------

    @property
    def error(self) -> CgxPsError | None:
        """The error that ended the exchange for good, if any."""
        return self._error

    @property
    def generation(self) -> int:
        """Which call carries the stream: a call's end matters only while it is the current one."""
        return self._generation

    @property
    def closing(self) -> bool:
        return self._closing

    # ---- the callers' side ----------------------------------------------------------------------

    async def exchange(self, block_id: int, round_: int, payload: Payload) -> Result:
        """Push one block for a round and wait for the aggregate of all nodes (a view of the
        received message when it came in one chunk: ``read_result``)."""
        refusal = _mislabelled(block_id, round_, payload)
        if refusal is not None:  # refused before expect(): no future is left waiting for it
            raise refusal
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
        refusal = _mislabelled(block_id, round_, payload)
        if refusal is not None:
            raise refusal
        async with self._write_lock:
            # kept under the lock: a repair pushes it exactly when this call does not
            self._unanswered[(block_id, round_)] = _Unanswered(payload, time.monotonic())
            if self._ready.is_set():
                generation = self._generation  # a repair may drop this call under the write
                try:
                    await self._write(block_id, round_, payload)
                except StreamEnded as exc:
                    self.broke(generation, f"stream closed while pushing: {exc}")
        self.bytes_sent += len(payload)

    async def fetch(self, block_id: int, round_: int, out_of_data: bool = False) -> Result:
        """A round's result without a push (quorum rounds: a node that fell behind): the shard
        answers once the round has closed. ``out_of_data`` (uneven inputs): the node has left the
        rounds and counts as pushed, without a gradient; b"" when every node has (EveryoneLeft)."""
        future = self.expect(block_id, round_)
        request = ps_pb2.ExchangeRequest(push=ps_pb2.PushChunk(round=round_, block_id=block_id, fetch=not out_of_data,
                                                               out_of_data=out_of_data))
        while True:
            await self.wait_ready()
            async with self._write_lock:
                generation = self._generation
                try:
                    await self._call.write(request.SerializeToString())
                    break
                except StreamEnded as exc:  # repaired, then asked again
                    self.broke(generation, f"stream closed while fetching: {exc}")
        return await future

    async def wait_ready(self) -> None:
        """Until the stream is open and carries every unanswered push (repaired, if it broke)."""
        while not self._ready.is_set():
            if self._error is not None:
                raise self._error
            await asyncio.sleep(0.05)

    # ---- the connection's side: calls come and go -----------------------------------------------

    async def attach(self, call: ExchangeCall, hello: bytes, restore: bool = False, resend: bool = False) -> tuple[int, int]:
        """Carry the exchange on ``call`` from now on: its ``hello`` first, then the last results
        back to a shard that lost them (``restore``: it restarted) and the unanswered pushes again
        (``resend``: a repair); ready once they are out. Returns (results restored, pushes sent
        again). A StreamEnded of the new call is raised, the call dropped."""
        async with self._write_lock:
            self._generation += 1
            generation = self._generation
            self._incoming.clear()
            self._call = call
            try:
                await call.write(hello)
                self._reader = asyncio.create_task(self._read_results(call, generation))
                restores = list(self._results.items()) if restore else []
                for block_id, (round_, result) in restores:
                    await self._write(block_id, round_, result, restore=True)
                again = list(self._unanswered.items()) if resend else []
                for key, entry in again:
                    if key in self._unanswered:  # its result may have come meanwhile
                        entry.since = time.monotonic()
                        await self._write(*key, entry.payload)
            except BaseException:
                if generation == self._generation:
                    self.drop()  # half carried: its own end is old news
                raise
            if generation == self._generation and self._error is None:
                self._ready.set()
        return len(restores), len(again)

    def drop(self) -> None:
        """Forget the current call (cancelled, and its reader): its end is old news from now on."""
        self._generation += 1
        self._ready.clear()
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()

    def reset(self) -> None:
        """Drop the current call and forget the error that ended the exchange, if any: a fresh start."""
        self.drop()
        self._error = None

    def broke(self, generation: int, cause: str) -> None:
        """The call of ``generation`` ended in a way a repair may mend (``wait_broken`` hears it),
        if it is still the current one."""
        if generation != self._generation or self._error is not None or self._closing:
            return
        self._ready.clear()
        self._break_cause = cause
        self._broken.set()

    async def wait_broken(self, timeout_s: float) -> str | None:
        """Why the current call broke, once it did (and not again until the next break); None if
        it did not within ``timeout_s``."""
        try:
            await asyncio.wait_for(self._broken.wait(), timeout_s)
        except asyncio.TimeoutError:
            return None
        self._broken.clear()
        return self._break_cause

    def oldest_unanswered(self) -> tuple[int, int, float] | None:
        """(block, round, when it was last pushed: time.monotonic()) of the push that has waited
        longest for its result on a ready stream; None if none waits (or the stream is not ready)."""
        if not self._ready.is_set() or not self._unanswered:
            return None
        (block_id, round_), oldest = next(iter(self._unanswered.items()))  # pushed first: waited longest
        return block_id, round_, oldest.since

    def still_unanswered(self, block_id: int, round_: int, since: float) -> bool:
        """Whether the push ``oldest_unanswered`` named still waits, not pushed again since, on a ready stream."""
        entry = self._unanswered.get((block_id, round_))
        return entry is not None and entry.since == since and self._ready.is_set()

    def fail(self, error: CgxPsError) -> None:
        """End every exchange with ``error`` (the first error is the cause: an in-band RoundError
        comes before the ABORTED status); nothing is pushed or restored again."""
        if self._error is None:
            self._error = error
            if self.on_error is not None and not self._closing:
                self.on_error(error)
        self._ready.clear()
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(self._error)
        self._waiting.clear()
        self._unanswered.clear()
        self._results.clear()
        self._incoming.clear()  # partial results of a connection that is over

    async def close(self) -> None:
        """Drop the call for good; whoever still waits gets an error."""
        self._closing = True
        self.drop()
        if self._reader is not None:
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        self.fail(CgxPsError(f"connection to shard {self.address} closed"))

    # ---- the wire -------------------------------------------------------------------------------

    async def _write(self, block_id: int, round_: int, payload: Payload, restore: bool = False) -> None:
        frames = chunk_frames(PUSH_FIELD, block_id, round_, payload, True) if restore else \
            push_frames(block_id, round_, payload)
        for frame in frames:
            await self._call.write(frame)

    async def _read_results(self, call: ExchangeCall, generation: int) -> None:
        ended: StreamEnded | None = None
        try:
            async for response in call:
                if isinstance(response, ChunkFrame):
                    self._take(response)
                    continue
                kind = response.WhichOneof("kind")
                if kind == "late":  # its result follows
                    n = response.late
                    self.late[n.block_id] = max(self.late.get(n.block_id, 0), n.next_round)
                    timeline.since(timeline.mark(), "late", n.round, timeline.block_track(n.block_id),
                                   block=n.block_id, next_round=n.next_round)
                    continue
                if kind == "everyone_left":  # the round has no result: b"" says so (fetch)
                    future = self._waiting.pop((response.everyone_left.block_id, response.everyone_left.round), None)
                    if future is not None and not future.done():
                        future.set_result(b"")
                    continue
                if kind == "error":
                    e = response.error
                    self.fail(RoundFailedError(self.address, e.message, tuple(e.missing_nodes)))
                    continue
                self._take(response.pull)
        except StreamEnded as exc:
            ended = exc
        except _MalformedResult as exc:  # a broken or hostile shard: nothing it sends next can be trusted
            if generation == self._generation:
                self.fail(CgxPsError(f"shard {self.address} sent a malformed result: {exc}; the shard is broken "
                                     f"or not a cgx-ps shard of this version"))
                self.drop()
            return
        if generation != self._generation:
            return  # a call we replaced or dropped
        code, details = (ended.code, ended.details) if ended is not None else (None, "")
        match after_stream_end(code, details, self._closing):
            case None:
                self.fail(CgxPsError(f"connection to shard {self.address} closed"))
            case Recover(cause):
                self.broke(generation, cause)
            case Fail("ABORTED", details):
                self.fail(RoundFailedError(self.address, details or "aborted"))
            case Fail(code, details):
                self.fail(ShardRejectedError(self.address, code, details))

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
        if self.keep_results and chunk.round >= self._results.get(chunk.block_id, (-1, b""))[0]:
            self._results[chunk.block_id] = (chunk.round, data)
        future = self._waiting.pop(key, None)
        if future is None and pushed:  # pushed without expect(): an early result is kept for it
            future = self._waiting[key] = asyncio.get_running_loop().create_future()
        if future is not None and not future.done():  # else: a second copy after a repair
            future.set_result(data)


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
