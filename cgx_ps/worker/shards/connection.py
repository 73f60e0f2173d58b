"""One node's control connection to one shard: the gRPC channel, which shard it is (Status), the
registration (Register, retried with backoff while the shard is not up yet), the TLS probe of a
connection the shard closed, and the Exchange streams opened on it (dataplane.open_exchange, on
the plane the last registration decided).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Awaitable, Callable, TypeVar

import grpc

from ... import __version__
from ...model_layout import layout_hash
from ...net.security import ChannelSecurity, read_token
from ...v1 import ps_pb2, ps_pb2_grpc
from ..config import dataplane_problem
from ..errors import CgxPsError, ConfigError, ShardRejectedError, ShardUnavailableError
from .dataplane import decide_dataplane, falls_back_to_grpc, open_exchange
from .exchange_call import ExchangeCall
from .recovery import closed_while_connecting, connect_failure
from .tls_probe import closed_connection_cause

__all__ = ["ShardConnection", "brief"]

log = logging.getLogger("cgx_ps.worker.shards.client")  # the client's log: one place to read a connection's story
_T = TypeVar("_T")
# while a worker waits for a shard at start: how often it says so (a silent wait looks like a hang)
_WAITING_NOTE_S = 15.0
_PLAIN = ChannelSecurity()  # no token, no TLS (frozen: one shared default is safe)


class ShardConnection:
    """The shard at ``address``, as the member ``member`` (node ``node_id`` of ``num_nodes``) of
    job ``job_id`` with ``layout`` reaches it: connecting must work within ``connect_timeout_s``;
    ``dataplane``: CGX_PS_DATAPLANE."""

    def __init__(self, address: str, node_id: str, num_nodes: int, layout: ps_pb2.Layout,
                 connect_timeout_s: float = 60.0, job_id: str = "", member: int = 0,
                 security: ChannelSecurity = _PLAIN, incarnation: int = 0, dataplane: str = "auto",
                 quorum: int = 0, grace_ms: int = 0) -> None:
        problem = dataplane_problem(dataplane, security.tls)
        if problem is not None:
            raise ConfigError(problem)
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
        self.dataplane = dataplane
        # quorum rounds, as every node of the job sends them (none: both 0)
        self.quorum, self.grace_ms = (quorum, grace_ms) if 0 < quorum < num_nodes else (0, 0)
        self.registration: ps_pb2.RegisterResponse | None = None
        self.metadata = security.metadata()  # the job token, sent with every call
        # the same token for the raw data plane's streams: both planes authenticate alike (read
        # once: a token file gone later would fail the raw plane's repairs only)
        self._token = read_token(security.token_file).encode() if security.token_file else b""
        self._channel: grpc.aio.Channel | None = None
        self._connect_deadline = 0.0  # time.monotonic() by which connecting must have worked
        # the plane of the Exchange stream, as the last registration decided it
        self._dataplane_warned = False
        self._data_port = 0  # the shard's raw data plane, while the stream takes it (until the next Register)
        self._just_registered = False  # no stream opened since the shard answered Register (falls_back_to_grpc)

    @property
    def session_id(self) -> str:
        """The shard session's proof of membership (from Register)."""
        return self.registration.session_id if self.registration is not None else ""

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            raise CgxPsError(f"shard {self.address}: not connected")
        return self._channel

    @property
    def round_timeout_s(self) -> float:
        """The shard's round timeout (from Register; 60 s before it answered, or if it named none)."""
        return (self.registration.round_timeout_s if self.registration else 0) or 60.0

    def stub(self) -> ps_pb2_grpc.ParameterServerStub:
        return ps_pb2_grpc.ParameterServerStub(self.channel)

    # ---- connecting -----------------------------------------------------------------------------

    async def identify(self) -> ps_pb2.StatusResponse:
        """Which shard this address is (its Status), retried with backoff within the connect
        deadline, as ``join`` is."""
        self._open_channel()
        return await self._until_answered(lambda: self.status(10.0, wait_for_ready=False))

    async def join(self) -> ps_pb2.RegisterResponse:
        """Register as a new member, retried with backoff within the connect deadline."""
        self._open_channel()
        await self._until_answered(lambda: self.register(resume=False, timeout=10.0))
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
                code, details = exc.code().name, exc.details() or ""
                fatal = connect_failure(self.address, code, details, self.security.tls)
                if fatal is None and not probed and closed_while_connecting(code, details):
                    probed = True  # once: a TLS mismatch does not change between attempts
                    cause = await asyncio.to_thread(closed_connection_cause, self.address, self.security)
                    fatal = ShardRejectedError(self.address, "TLS", cause) if cause else None
                if fatal is not None:
                    raise fatal from None
                now = time.monotonic()
                if now + delay <= deadline and now >= say_at:  # a worker waiting in silence looks hung
                    log.warning("shard %s not reachable yet (%s); retrying for up to %.0fs more "
                                "(CGX_PS_CONNECT_TIMEOUT)", self.address, brief(exc), deadline - now)
                    say_at = now + _WAITING_NOTE_S
                if now + delay > deadline:
                    raise ShardUnavailableError(
                        f"shard {self.address} unreachable for {self.connect_timeout_s:g}s "
                        f"(last error: {code}: {details}); check CGX_PS_SERVERS and that the shard is "
                        f"running") from None
                await asyncio.sleep(delay * (0.5 + random.random()))  # jitter: nodes retry apart
                delay = min(delay * 2, 2.0)

    # ---- one call each (raise grpc's AioRpcError) -----------------------------------------------

    async def status(self, timeout: float, wait_for_ready: bool | None = None) -> ps_pb2.StatusResponse:
        return await self.stub().Status(ps_pb2.StatusRequest(), timeout=timeout, wait_for_ready=wait_for_ready,
                                        metadata=self.metadata)

    async def answers(self, timeout: float) -> bool:
        """Whether the shard answers a Status call within ``timeout`` (alive, if slow)."""
        try:
            await self.status(timeout)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def register(self, resume: bool, timeout: float) -> None:
        """Register (``resume``: again, in a session the shard lost by restarting), and decide the
        plane of the streams that follow from the shard's answer."""
        # Rejoining, present the incarnation the shard counted for our start (admission.py), the
        # same for every member of it: our launcher's count may differ from our peers'.
        incarnation = self.registration.incarnation if resume else self.incarnation
        request = ps_pb2.RegisterRequest(node_id=self.node_id, num_nodes=self.num_nodes, layout=self.layout,
                                         layout_hash=self.layout_hash, client_version=__version__,
                                         job_id=self.job_id, member=self.member, resume=resume,
                                         incarnation=incarnation, quorum=self.quorum, grace_ms=self.grace_ms)
        self.registration = await self.stub().Register(request, timeout=timeout, wait_for_ready=False,
                                                       metadata=self.metadata)
        # a restarted shard may listen on another data port, or none
        choice = decide_dataplane(self.dataplane, self.registration.data_port, self.security.tls, self.address)
        if choice.warning and not self._dataplane_warned:
            self._dataplane_warned = True
            log.warning("%s", choice.warning)
        self._data_port = self.registration.data_port if choice.plane == "raw" else 0
        self._just_registered = True

    async def renew_channel(self) -> None:
        """Close the channel and open another, which connects now, not after gRPC's backoff."""
        if self._channel is not None:
            await self._channel.close()
        self._channel = self.security.aio_channel(self.address)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    # ---- the Exchange stream --------------------------------------------------------------------

    def hello(self) -> bytes:
        """The first message of every Exchange stream: who we are, in which session."""
        return ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(
            node_id=self.node_id, layout_hash=self.layout_hash, member=self.member,
            session_id=self.session_id)).SerializeToString()

    async def open_exchange(self) -> ExchangeCall:
        """A new Exchange stream, on the plane the last Register decided. A data port that cannot
        be reached right after Register (falls_back_to_grpc) sends the streams to gRPC until the
        shard next answers Register; otherwise its StreamEnded is raised (UNAVAILABLE: recovery
        retries it)."""
        just_registered, self._just_registered = self._just_registered, False
        call = await open_exchange(self.address, self.channel, self.metadata, self._data_port, self._token,
                                   falls_back_to_grpc(self.dataplane, just_registered))
        if call.plane != "raw":
            self._data_port = 0
        return call


def brief(exc: Exception) -> str:
    """One line for the log: an RPC error's status, not its multi-line repr."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
