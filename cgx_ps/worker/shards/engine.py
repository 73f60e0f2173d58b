"""The worker's communication thread: one event loop, one ShardClient per shard.

Each ShardClient repairs its own connection when a shard restarts or the network drops it
(client.py, recovery.py): pushes wait for the repair instead of failing, so both front ends of
the block pipeline survive a shard restart without knowing about it.

Training code runs in its own thread (autograd's); the block pipeline (``pipeline.py``) hands
each block's work over with ``submit``, which returns a ``concurrent.futures.Future``. Codec
kernels run in the loop's executor (``in_thread``: they release the GIL) and pushes on the
loop, so the compression, the network and the decompression of different blocks overlap each
other and the rest of backward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Awaitable, Callable, Iterable

import grpc

from ...net.channel_options import CHUNK_BYTES, chunks
from ...v1 import ps_pb2, ps_pb2_grpc
from .client import Payload, Result, ShardClient
from ..config import WorkerConfig
from ..errors import BroadcastError, CgxPsError, ConfigError
from ..broadcast.joining import absent_nodes, nodes_joined, report_absent_nodes

__all__ = ["CODEC_DRAIN_S", "CommEngine", "EngineShare", "shard_order_problem", "stripes"]

log = logging.getLogger(__name__)
# How long close() waits for codec calls in flight: a block's encode or decode takes milliseconds;
# a call still running after this is stuck, not slow.
CODEC_DRAIN_S = 10.0


def shard_order_problem(position: int, address: str, shard_index: int, num_shards: int) -> str | None:
    """Why CGX_PS_SERVERS[position] may not be the shard at ``address`` (which says it is shard
    ``shard_index`` of ``num_shards``); None if it may. Blocks go to the shard at their owner's
    position: a shard listed elsewhere would be sent blocks it does not own."""
    if shard_index == position:
        return None
    return (f"CGX_PS_SERVERS[{position}]={address} is shard {shard_index} of {num_shards}: list the shards "
            f"in index order on every worker")


def stripes(data: bytes, n: int) -> list[memoryview]:
    """``data`` cut into ``n`` contiguous parts of sizes differing by at most one byte (empty ones
    where it is shorter than ``n``), part ``i`` for shard ``i``.

    A broadcast used to go through shard 0 alone: its link carried a copy to every other node
    (7 copies of ResNet-50's 102 MB at 8 nodes: 57 s at 100 Mbit/s, about the default round
    timeout, so nodes that had the parameters first timed out their first round waiting for the
    rest). Striped, each shard's link carries its 1/n of every copy, and the downloads run at
    every reader's own link rate."""
    size, extra = divmod(len(data), n)
    view = memoryview(data)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [view[bounds[i]:bounds[i + 1]] for i in range(n)]  # views: the blob is not copied again


class CommEngine:
    def __init__(self, config: WorkerConfig, node_id: str, num_nodes: int, member: int = 0,
                 codec_threads: int = 2) -> None:
        self.config = config
        self.node_id = node_id
        self.num_nodes = num_nodes
        self.member = member
        self.clients: list[ShardClient] = []
        self.executor = concurrent.futures.ThreadPoolExecutor(codec_threads, thread_name_prefix="cgx-codec")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="cgx-comm", daemon=True)
        self._thread.start()
        self.round_timeout_s = 60.0
        self.closed = False
        self._on_close: list[Callable[[], None]] | None = []  # what lives only as long as the session
        self._on_close_lock = threading.Lock()  # callbacks come from autograd's thread too

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _call(self, coro, timeout: float | None = None):
        return self.submit(coro).result(timeout)

    # ---- setup ----------------------------------------------------------------------------------

    def connect(self, layout: ps_pb2.Layout) -> None:
        """Register with every shard (concurrently) and open the Exchange streams."""
        if len(self.config.servers) != layout.num_shards:
            raise ConfigError(f"layout has {layout.num_shards} shards, CGX_PS_SERVERS lists "
                              f"{len(self.config.servers)}")
        self.clients = [ShardClient(a, self.node_id, self.num_nodes, layout, self.config.connect_timeout_s,
                                    self.config.job_id, self.member, self.config.security,
                                    incarnation=self.config.incarnation,
                                    recovery_timeout_s=self.config.recovery_timeout_s,
                                    dataplane=self.config.dataplane, quorum=self.config.quorum,
                                    grace_ms=self.config.grace_ms)
                        for a in self.config.servers]
        for c in self.clients:
            c.on_error = self._one_shard_failed

        async def identify_all() -> list[ps_pb2.StatusResponse]:
            return await asyncio.gather(*[c.identify() for c in self.clients])

        async def connect_all() -> None:
            await asyncio.gather(*[c.connect() for c in self.clients])

        # the order first: refused after registering, this worker would leave an idle session behind
        for i, status in enumerate(self._call(identify_all())):
            self._check_order(i, status.shard_index, status.num_shards)
        self._call(connect_all())
        for i, c in enumerate(self.clients):  # a shard restarted in between with another index
            self._check_order(i, c.registration.shard_index, c.registration.num_shards)
        self.round_timeout_s = max(c.registration.round_timeout_s for c in self.clients)

    def _check_order(self, position: int, shard_index: int, num_shards: int) -> None:
        problem = shard_order_problem(position, self.config.servers[position], shard_index, num_shards)
        if problem is not None:
            raise ConfigError(problem)

    def _one_shard_failed(self, failed: ShardClient, error: CgxPsError) -> None:
        """A shard's connection ended the job (not back within the recovery timeout, a failed
        round, a refusal): the exchanges waiting on the other shards end with the same error now.
        They would not complete: their rounds wait for the pushes of nodes that stop on this error
        too. Left waiting, a front end that waits for a block of another shard first would report
        that shard's round timeout (a minute by default) instead of the cause, that much later."""
        for c in self.clients:
            if c is not failed and c.error is None:
                c.abandon(error)

    @property
    def session_id(self) -> str:
        """Shard 0's session id: the same for every member of the job's current session, and
        known only to them (local ranks name their intra-node rendezvous after it)."""
        return self.clients[0].session_id if self.clients else ""

    def when_closed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once ``close()`` ends the session (on the closing thread), at once if it
        has: the DDP hook's autograd hooks are removed then, not left to act for a closed session."""
        with self._on_close_lock:
            pending = self._on_close is not None
            if pending:
                self._on_close.append(callback)
        if not pending:
            callback()

    def close(self) -> None:
        try:
            self._close()
        finally:
            with self._on_close_lock:
                callbacks, self._on_close = self._on_close or [], None
            for callback in callbacks:
                callback()

    def _close(self) -> None:
        if self.closed or not self._thread.is_alive():
            self.closed = True
            return

        async def close_all() -> None:
            for c in self.clients:
                await c.close()

        try:
            self._call(close_all(), timeout=10)
        finally:
            self.closed = True  # from here on, submit() says so instead of waiting forever
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self._drain_codec_threads(CODEC_DRAIN_S)

    def _drain_codec_threads(self, timeout_s: float) -> None:
        """Drop the codec calls not started and wait, at most ``timeout_s``, for those running:
        ``shutdown()`` unmaps the local ranks' buffers next (intra-node reduction), and a codec
        thread still reading a peer's GPU memory or a segment then would fault. A call stuck
        longer (a hung GPU) is logged and left, so that close() returns (the interpreter's exit
        still joins the codec threads, as concurrent.futures does for any pool)."""
        stopper = threading.Thread(target=self.executor.shutdown, kwargs={"wait": True, "cancel_futures": True},
                                   name="cgx-codec-drain", daemon=True)
        try:
            stopper.start()
        except RuntimeError:
            # No new thread: at interpreter exit (runtime.py's atexit shutdown) Python 3.12.0-3.12.1
            # refuse one ("can't create new thread at interpreter shutdown"); raising would skip the
            # rest of shutdown() (the intra-node unmapping, the timeline's file). There the wait is
            # immediate: concurrent.futures' own exit hook, which runs before atexit's, has let the
            # codec threads finish and joined them. Elsewhere (no thread to be had) it is unbounded.
            self.executor.shutdown(wait=True, cancel_futures=True)
            return
        stopper.join(timeout_s)
        if stopper.is_alive():
            log.warning("a codec call was still running %gs after the connection closed; unmapping the local "
                        "ranks' buffers anyway", timeout_s)

    # ---- blocks ---------------------------------------------------------------------------------

    def submit(self, coro: Awaitable[int]) -> concurrent.futures.Future[int]:
        """Run a coroutine on the communication loop; returns a thread-safe future."""
        if self.closed or not self._thread.is_alive():
            coro.close()  # never awaited: say so without a warning
            raise CgxPsError("cgx_ps.worker.shutdown() has closed the connection to the shards; to train on, "
                             "call cgx_ps.worker.init() and create a new DistributedOptimizer (DDP: a new DDP "
                             "model with a new DDPHookState)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def in_thread(self, fn: Callable, *args):
        """Run blocking work (a codec kernel) on a codec thread."""
        return await self.loop.run_in_executor(self.executor, fn, *args)

    def wire_block(self, block_id: int) -> int:
        """The shards' id of block ``block_id`` (what ``PushFrames`` made for ``push_pull`` carry)."""
        return block_id

    async def push_pull(self, shard: int, block_id: int, round_: int, payload: Payload) -> Result:
        """Push a block's payload for a round to its shard; returns the aggregate of all nodes."""
        return await self.clients[shard].exchange(block_id, round_, payload)

    async def fetch(self, shard: int, block_id: int, round_: int, out_of_data: bool = False) -> Result:
        """A round's result from a block's shard without a push (quorum rounds: catching up;
        ``out_of_data``: uneven inputs, ``ShardClient.fetch``)."""
        return await self.clients[shard].fetch(block_id, round_, out_of_data)

    def late_notice(self, block_ids: Iterable[int]) -> int | None:
        """Quorum rounds: the furthest round these (shard) blocks were at when a shard told this
        node it was late (the round under way then), None if none did; the notices are used up."""
        rounds = [client.stream.late.pop(block_id) for client in self.clients for block_id in block_ids
                  if block_id in client.stream.late]
        return max(rounds, default=None)

    @property
    def recoveries(self) -> tuple[int, float]:
        """Connections to shards repaired so far, and the seconds spent repairing them."""
        return sum(c.recoveries for c in self.clients), sum(c.recovery_s for c in self.clients)

    def shard_error(self, shard: int) -> CgxPsError | None:
        """The error that ended the stream to a shard (a failed round, a closed shard), if any."""
        return self.clients[shard].error

    # ---- control (adaptive compression, auto mode) ------------------------------------------------

    def set_codecs(self, from_round: int, blocks: list[ps_pb2.BlockCodec], resume: bool = False) -> None:
        """Announce new block settings to every shard (each keeps the blocks it owns); with
        ``resume``, the blocks start at ``from_round`` (a job resuming from a checkpoint)."""
        async def announce() -> None:
            await asyncio.gather(*[c.set_codecs(from_round, blocks, resume) for c in self.clients])

        self._call(announce())

    def probe(self, nbytes_per_shard: int) -> float:
        """Aggregate upload throughput to all shards at once, bytes per second."""
        async def run() -> float:
            await asyncio.gather(*[c.probe(CHUNK_BYTES) for c in self.clients])  # warm the streams
            t0 = time.perf_counter()
            await asyncio.gather(*[c.probe(nbytes_per_shard) for c in self.clients])
            return len(self.clients) * nbytes_per_shard / (time.perf_counter() - t0)

        return self._call(run())

    # ---- blobs (broadcast) ------------------------------------------------------------------------

    # Blobs live on shard 0, in its session: they travel over that shard's connection, with the
    # job token and the session id, and come back with the member that wrote them.

    def put_blob(self, key: str, data: bytes) -> None:
        """Publish ``data`` under ``key``, striped over every shard's blob store (``stripes``)."""
        async def put(shard: ShardClient, part: memoryview) -> None:
            pieces = [ps_pb2.BlobChunk(key=key, total_bytes=len(part), offset=o, data=piece, node_id=self.node_id,
                                       member=self.member, session_id=shard.session_id)
                      for o, piece in chunks(part)]
            await ps_pb2_grpc.ParameterServerStub(shard.channel).PutBlob(iter(pieces), timeout=120,
                                                                         metadata=shard.metadata)

        async def put_all() -> None:
            await asyncio.gather(*(put(shard, part) for shard, part in zip(self.clients, stripes(data, len(self.clients)))))

        self._rpc(put_all(), f"broadcast put {key!r}")

    def get_blob(self, key: str, timeout_s: float) -> tuple[bytes, tuple[str, int]]:
        """A blob's bytes (its stripes from every shard, joined) and who wrote it: (node id, member).
        While it waits, says which nodes have not joined the job (joining.py); if it times out with
        nodes missing, blames them. BroadcastError if the stripes' writers differ."""
        what = f"broadcast get {key!r}"

        async def get(shard: ShardClient) -> tuple[bytes, tuple[str, int]]:
            call = ps_pb2_grpc.ParameterServerStub(shard.channel).GetBlob(
                ps_pb2.GetBlobRequest(key=key, timeout_s=timeout_s, session_id=shard.session_id),
                timeout=timeout_s + 30, metadata=shard.metadata)
            try:
                parts, writer = [], ("", 0)
                async for chunk in call:
                    parts.append(chunk.data)
                    writer = (chunk.node_id, chunk.member)
                return b"".join(parts), writer
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or (joined := await nodes_joined(shard)) is None:
                    raise
                absent = absent_nodes(joined[1], joined[0], self.config.node_rank)
                if not absent:
                    raise
                raise BroadcastError(f"{what} on shard {shard.address} failed: node(s) never joined the job: {absent} "
                                     f"({joined[0]} of {joined[1]} nodes registered with the shard within "
                                     f"{timeout_s:g}s); start them, or check that they use the same CGX_PS_SERVERS, "
                                     f"CGX_PS_JOB_ID and CGX_PS_NUM_NODES ({exc.details()})") from None

        async def get_all() -> tuple[bytes, tuple[str, int]]:
            first = self.clients[0]
            reporter = asyncio.create_task(report_absent_nodes(first, f"blob {key!r}", self.config.node_rank))
            try:
                parts = await asyncio.gather(*(get(shard) for shard in self.clients))
            finally:
                reporter.cancel()
            writers = {writer for _, writer in parts}
            if len(writers) > 1:
                raise BroadcastError(f"{what}: its stripes on the shards were written by different members "
                                     f"({', '.join(f'{n!r} member {m}' for n, m in sorted(writers))}): refused")
            return b"".join(part for part, _ in parts), parts[0][1]

        return self._rpc(get_all(), what)

    def _rpc(self, coro, what: str):
        try:
            return self._call(coro)
        except grpc.aio.AioRpcError as exc:
            raise CgxPsError(f"{what} on shard {self.config.servers[0]} failed: "
                             f"{exc.code().name}: {exc.details()}") from None


class EngineShare:
    """One model's share of the process's engine, when several models train in one process (a
    GAN's two DDP models): the session's layout is theirs end to end (``merge_layouts``), and
    this share's block ``b`` is block ``offset + b`` on the shards. What a block pipeline uses
    of a ``CommEngine``, with its own block ids."""

    def __init__(self, engine: CommEngine, offset: int, index: int) -> None:
        self.engine, self.offset, self.index = engine, offset, index

    @property
    def round_timeout_s(self) -> float:
        return self.engine.round_timeout_s

    @property
    def session_id(self) -> str:
        """Names this share's intra-node rendezvous: each model's local ranks meet on their own."""
        return f"{self.engine.session_id}/{self.index}"

    def submit(self, coro: Awaitable[int]) -> concurrent.futures.Future[int]:
        return self.engine.submit(coro)

    async def in_thread(self, fn: Callable, *args):
        return await self.engine.in_thread(fn, *args)

    def wire_block(self, block_id: int) -> int:
        return self.offset + block_id

    async def push_pull(self, shard: int, block_id: int, round_: int, payload: Payload) -> Result:
        return await self.engine.push_pull(shard, self.offset + block_id, round_, payload)

    async def fetch(self, shard: int, block_id: int, round_: int, out_of_data: bool = False) -> Result:
        return await self.engine.fetch(shard, self.offset + block_id, round_, out_of_data)

    def late_notice(self, block_ids: Iterable[int]) -> int | None:
        return self.engine.late_notice([self.offset + b for b in block_ids])

    def shard_error(self, shard: int) -> CgxPsError | None:
        return self.engine.shard_error(shard)

    def when_closed(self, callback: Callable[[], None]) -> None:
        self.engine.when_closed(callback)

    def set_codecs(self, from_round: int, blocks: list[ps_pb2.BlockCodec], resume: bool = False) -> None:
        self.engine.set_codecs(from_round, [ps_pb2.BlockCodec(block_id=self.offset + b.block_id, codec=b.codec)
                                            for b in blocks], resume)

    def probe(self, nbytes_per_shard: int) -> float:
        return self.engine.probe(nbytes_per_shard)
