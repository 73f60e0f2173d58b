"""One node's connection to one shard: Register, then a long-lived Exchange stream, kept alive.

    client = ShardClient(address, node_id, num_nodes, layout, recovery_timeout_s=60)
    await client.connect()                       # retries with backoff, then a clear error
    result = await client.exchange(block_id, round, payload)   # push, then await the aggregate

``ShardClient`` is a facade over three parts, each with one job, which talk through public methods:

* ``ShardConnection`` (connection.py): the gRPC channel, Status and Register with backoff, the TLS
  probe, and the Exchange streams opened on the plane Register decided (dataplane.py: gRPC, or the
  raw data plane; either is an ``ExchangeCall``, exchange_call.py).
* ``ExchangeStream`` (exchange_stream.py): pushes, and results matched to waiting callers by
  (block, round); what a push and a block's last result need to be carried again after a repair.
* ``ConnectionSupervisor`` (supervisor.py): the repair. When the stream breaks (the shard died,
  is restarting, or the connection dropped) it reconnects with backoff. The same shard instance
  kept the session: reopen a stream and push the unanswered blocks again (duplicates are harmless
  there). A restarted instance lost it: register again as a resuming node, give back the last
  results and push the unanswered blocks again, under the same round numbers (recovery.py decides).

Callers waiting for results notice nothing of a repair. They fail, with an error naming the
shard, when it is not back within ``recovery_timeout_s`` (0: at once), when a round failed for
everyone, on a refusal, and when a push stays unanswered past the shard's round timeout on a
connection that looks healthy (a stopped or hung shard).
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

import grpc

from ...net.channel_options import CHUNK_BYTES
from ...net.security import ChannelSecurity
from ...v1 import ps_pb2
from ..errors import CgxPsError, ShardRejectedError, ShardUnavailableError, StreamEnded
from .connection import ShardConnection
from .exchange_call import read_result
from .exchange_stream import ExchangeStream, Payload, Result, push_frames, result_chunk_problem
from .recovery import broke_under_write
from .supervisor import ConnectionSupervisor

__all__ = ["Payload", "Result", "ShardClient", "push_frames", "read_result", "result_chunk_problem"]

_T = TypeVar("_T")
_PLAIN = ChannelSecurity()  # no token, no TLS (frozen: one shared default is safe)


class ShardClient:
    """The connection to the shard at ``address`` (the arguments: ShardConnection's), repaired
    for up to ``recovery_timeout_s`` after each break (0: a break ends it)."""

    # the parts' kinds: a benchmark may carry the stream another way (benchmarks/rawplane.py)
    connection_type = ShardConnection
    stream_type = ExchangeStream

    def __init__(self, address: str, node_id: str, num_nodes: int, layout: ps_pb2.Layout,
                 connect_timeout_s: float = 60.0, job_id: str = "", member: int = 0,
                 security: ChannelSecurity = _PLAIN, incarnation: int = 0,
                 recovery_timeout_s: float = 0.0, dataplane: str = "auto", quorum: int = 0,
                 grace_ms: int = 0) -> None:
        self.connection = self.connection_type(address, node_id, num_nodes, layout, connect_timeout_s, job_id,
                                               member, security, incarnation, dataplane, quorum, grace_ms)
        self.stream = self.stream_type(address, layout, keep_results=recovery_timeout_s > 0)
        self.stream.on_error = self._failed
        self.supervisor = ConnectionSupervisor(self.connection, self.stream, recovery_timeout_s)
        # who and where, as the connection has them (fixed for the client's life)
        self.address, self.node_id, self.num_nodes, self.layout = address, node_id, num_nodes, layout
        self.layout_hash, self.job_id, self.member = self.connection.layout_hash, job_id, member
        self.incarnation, self.security, self.dataplane = incarnation, security, dataplane
        self.connect_timeout_s = connect_timeout_s
        self.recovery_timeout_s = recovery_timeout_s  # how long to wait for a lost shard; 0: fail at once
        # told of the error that ends this connection (not of a close we asked for): the engine
        # ends the job's exchanges on the other shards with it (CommEngine._one_shard_failed)
        self.on_error: Callable[["ShardClient", CgxPsError], None] | None = None

    def _failed(self, error: CgxPsError) -> None:
        if self.on_error is not None:
            self.on_error(self, error)

    # ---- setup ----------------------------------------------------------------------------------

    async def identify(self) -> ps_pb2.StatusResponse:
        """Which shard this address is (its Status), asked before registering anywhere: a worker
        that lists the shards out of order learns it while no shard holds a session for it
        (registered, it would leave an idle session behind on every shard it reached). Retries
        as ``connect`` does, within the same ``connect_timeout_s``."""
        return await self.connection.identify()

    async def connect(self) -> ps_pb2.RegisterResponse:
        registration = await self.connection.join()
        try:
            await self.stream.attach(await self.connection.open_exchange(), self.connection.hello())
        except StreamEnded as exc:  # CGX_PS_DATAPLANE=raw, and its port cannot be reached
            raise ShardUnavailableError(f"shard {self.address}: {exc.details} "
                                        f"(CGX_PS_DATAPLANE={self.connection.dataplane})") from None
        self.supervisor.start()
        return registration

    async def reopen(self) -> None:
        """Open a fresh Exchange stream after the old one ended (no new Register, so the
        session and its rounds go on), even after an error ended the old one. Results of the old
        stream that never arrived are lost; push those blocks again and the shard resends
        finished results."""
        self.stream.reset()
        await self.stream.attach(await self.connection.open_exchange(), self.connection.hello())
        self.supervisor.start()

    async def close(self) -> None:
        self.supervisor.stop()
        await self.stream.close()
        await self.connection.close()

    @property
    def registration(self) -> ps_pb2.RegisterResponse | None:
        return self.connection.registration

    @property
    def session_id(self) -> str:
        """The shard session's proof of membership (from Register)."""
        return self.connection.session_id

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self.connection.metadata

    @property
    def channel(self) -> grpc.aio.Channel:
        return self.connection.channel

    @property
    def error(self) -> CgxPsError | None:
        """The error that ended this connection for good (a failed round, a shard not back in
        time, a refusal), if any; a connection being repaired has none."""
        return self.stream.error

    @property
    def recoveries(self) -> int:
        """Streams repaired."""
        return self.supervisor.recoveries

    @property
    def recovery_s(self) -> float:
        """Total seconds spent repairing them."""
        return self.supervisor.recovery_s

    @property
    def bytes_sent(self) -> int:
        return self.stream.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.stream.bytes_received

    # ---- control: adaptive settings, link probe -------------------------------------------------

    async def set_codecs(self, from_round: int, blocks: list[ps_pb2.BlockCodec], resume: bool = False) -> None:
        """Announce blocks' settings from a round on; ``resume``: they start there (a checkpoint).
        (A shard that restarts in between learns the settings from the pushes themselves.)"""
        def announce():  # made anew for a retry: a rejoin changed the session id
            request = ps_pb2.SetCodecsRequest(node_id=self.node_id, from_round=from_round, blocks=blocks,
                                              session_id=self.session_id, resume=resume)
            return self.connection.stub().SetCodecs(request, timeout=30, metadata=self.metadata)

        await self._control("SetCodecs", announce)

    async def probe(self, nbytes: int) -> float:
        """Seconds to upload nbytes to the shard (1 MiB chunks, as pushes travel)."""
        chunk = ps_pb2.ProbeChunk(data=bytes(min(nbytes, CHUNK_BYTES)))
        count = max(1, nbytes // CHUNK_BYTES)

        async def timed() -> float:
            t0 = time.perf_counter()
            await self.connection.stub().Probe(iter([chunk] * count), timeout=120, metadata=self.metadata)
            return time.perf_counter() - t0

        return await self._control("Probe", timed)

    async def _control(self, what: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """A control call through recovery: made on a ready connection, and made once more when
        the shard went away under it, after the supervisor repaired the connection."""
        for attempt in range(2):
            await self.stream.wait_ready()
            channel, generation = self.connection.channel, self.stream.generation  # the connection this attempt uses
            try:
                return await call()
            except asyncio.CancelledError:
                if self.connection.channel is channel or attempt:
                    raise  # we are being cancelled
                # the supervisor closed the channel under the call to reconnect: the shard went away
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code().name, exc.details() or ""
                gone = code == "UNAVAILABLE" or broke_under_write(code, details)
                if not gone:
                    raise ShardRejectedError(self.address, code, details) from None
                if attempt or self.recovery_timeout_s <= 0:  # gone, and not back: not a refusal
                    raise ShardUnavailableError(f"shard {self.address} went away during {what}: {code}: "
                                                f"{details}") from None
                # Only the connection the call used is broken: if the supervisor already replaced
                # it (the stream's reader saw the shard go first), the next attempt waits for that.
                self.stream.broke(generation, f"{what}: {code}: {details}")
        raise AssertionError("unreachable: the second attempt returns or raises")

    # ---- push / pull ----------------------------------------------------------------------------

    async def exchange(self, block_id: int, round_: int, payload: Payload) -> Result:
        """Push one block for a round and wait for the aggregate of all nodes (a view of the
        received message when it came in one chunk: ``read_result``)."""
        return await self.stream.exchange(block_id, round_, payload)

    def expect(self, block_id: int, round_: int) -> asyncio.Future[Result]:
        """Register interest in a result before pushing (so an early result is never missed)."""
        return self.stream.expect(block_id, round_)

    async def push(self, block_id: int, round_: int, payload: Payload) -> None:
        """Send a block's payload for a round; kept until its result arrives. While the stream is
        being repaired it is only kept: the repair pushes it."""
        await self.stream.push(block_id, round_, payload)

    async def fetch(self, block_id: int, round_: int, out_of_data: bool = False) -> Result:
        """A round's result without a push (quorum rounds: a node that fell behind catches up;
        ``out_of_data``: a node that left the rounds, b"" once every node has: uneven inputs)."""
        return await self.stream.fetch(block_id, round_, out_of_data)

    def abandon(self, error: CgxPsError) -> None:
        """End every exchange waiting on this shard with ``error``, which ended the job elsewhere
        (another shard's connection): their rounds wait for nodes that stop now."""
        self.stream.fail(error)
