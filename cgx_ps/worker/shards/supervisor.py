"""The repair of a shard connection: a supervisor task per ``ShardClient``.

When the Exchange stream breaks, the supervisor reconnects with backoff and carries out what
recovery.py decides (reopen a stream in the same shard instance, or rejoin a restarted one and
restore the last results), then has the stream push again what is unanswered. Between breaks it
watches for a push left unanswered too long on a connection that looks healthy (a stopped or
hung shard). It drives the two halves of the client through their public methods: the control
connection (connection.py) and the exchange stream (exchange_stream.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from ..errors import CgxPsError, ShardUnavailableError, StreamEnded
from .connection import ShardConnection
from .exchange_stream import ExchangeStream
from .recovery import LIVENESS_TIMEOUT_S, Backoff, Rejoin, connect_failure, hung_after_s, is_hung, reconnect_action

__all__ = ["ConnectionSupervisor"]

log = logging.getLogger("cgx_ps.worker.shards.client")  # the client's log: one place to read a connection's story
_WATCH_INTERVAL_S = 0.5  # how often the supervisor looks for a push unanswered too long
_ATTEMPT_TIMEOUT_S = 5.0  # one reconnect attempt's RPCs (a stopped shard accepts TCP but never answers)


class _TryAgain(Exception):
    """A reconnect attempt failed in a way the next attempt may not."""


class ConnectionSupervisor:
    """Repairs ``stream``'s calls to the shard of ``connection`` for up to ``recovery_timeout_s``
    after each break (0: a break ends the exchange at once)."""

    def __init__(self, connection: ShardConnection, stream: ExchangeStream, recovery_timeout_s: float) -> None:
        self.connection = connection
        self.stream = stream
        self.recovery_timeout_s = recovery_timeout_s
        self.recoveries = 0  # streams repaired
        self.recovery_s = 0.0  # total seconds spent repairing them
        self._task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.connection.address

    def start(self) -> None:
        """Supervise from now on (once: a running supervisor goes on)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        try:
            while self.stream.error is None and not self.stream.closing:
                cause = await self.stream.wait_broken(_WATCH_INTERVAL_S)
                if cause is None:
                    await self._check_hung()
                else:
                    await self._recover(cause)
        except Exception as exc:  # noqa: BLE001 - a dead supervisor would leave callers waiting forever
            log.exception("shard %s: connection supervisor failed", self.address)
            self.stream.fail(CgxPsError(f"shard {self.address}: the connection supervisor failed: {exc!r}"))

    async def _check_hung(self) -> None:
        oldest = self.stream.oldest_unanswered()
        if oldest is None:
            return
        block_id, round_, since = oldest
        round_timeout = self.connection.round_timeout_s
        waited = time.monotonic() - since
        if waited <= hung_after_s(round_timeout):
            return
        if not is_hung(waited, round_timeout, await self.connection.answers(LIVENESS_TIMEOUT_S)):
            log.warning("shard %s: no result for block %d round %d in %.1fs, but it answers: slow, not hung",
                        self.address, block_id, round_, waited)
        elif self.stream.still_unanswered(block_id, round_, since):
            self.stream.fail(ShardUnavailableError(
                f"shard {self.address} sent no result for block {block_id} round {round_} in {waited:.1f}s, "
                f"although it fails any round within its round timeout ({round_timeout:g}s): the shard is "
                f"stopped, hung or cut off; check its process and logs"))
            self.stream.drop()

    async def _recover(self, cause: str) -> None:
        if self.recovery_timeout_s <= 0:
            self.stream.fail(ShardUnavailableError(f"shard {self.address} went away ({cause}); recovery is off "
                                                   f"(CGX_PS_RECOVERY_TIMEOUT=0)"))
            return
        started = time.monotonic()
        deadline = started + self.recovery_timeout_s
        log.warning("shard %s: connection lost (%s); reconnecting for up to %gs", self.address, cause,
                    self.recovery_timeout_s)
        self.stream.drop()
        backoff, last = Backoff(), cause
        while self.stream.error is None and not self.stream.closing:
            try:
                how = await self._reconnect(deadline)
            except _TryAgain as exc:
                last = str(exc)
            except CgxPsError as exc:  # a refusal: trying again cannot help
                self.stream.fail(exc)
                return
            else:
                took = time.monotonic() - started
                self.recoveries += 1
                self.recovery_s += took
                log.warning("shard %s: %s after %.2fs", self.address, how, took)
                return
            delay = backoff.next()
            if time.monotonic() + delay >= deadline:
                self.stream.fail(ShardUnavailableError(
                    f"shard {self.address} did not come back within the recovery timeout of "
                    f"{self.recovery_timeout_s:g}s (CGX_PS_RECOVERY_TIMEOUT): waited {time.monotonic() - started:.1f}s "
                    f"after losing it ({cause}); last error: {last}"))
                return
            await asyncio.sleep(delay)

    async def _reconnect(self, deadline: float) -> str:
        """One attempt: a new channel, then reopen or rejoin, then push again what is unanswered.
        Returns what it did; raises _TryAgain, or a CgxPsError that ends the job."""
        timeout = max(0.2, min(_ATTEMPT_TIMEOUT_S, deadline - time.monotonic()))
        connection = self.connection
        await connection.renew_channel()
        try:
            status = await connection.status(timeout)
            if status.draining:
                raise _TryAgain("the shard is draining for a restart")
            rejoin = isinstance(reconnect_action(connection.registration.instance_id, status.instance_id), Rejoin)
            if rejoin:
                await connection.register(resume=True, timeout=timeout)
            call = await connection.open_exchange()
            restored, again = await self.stream.attach(call, connection.hello(), restore=rejoin, resend=True)
        except grpc.aio.AioRpcError as exc:  # a control call's
            raise self._attempt_failed(exc.code().name, exc.details() or "") from None
        except StreamEnded as exc:  # the new stream's
            raise self._attempt_failed(exc.code, exc.details) from None
        what = "rejoined the restarted shard" if rejoin else "reopened the stream"
        return f"{what}: {restored} result(s) restored, {again} push(es) sent again"

    def _attempt_failed(self, code: str, details: str) -> Exception:
        """What ends a reconnect attempt that failed with the status ``code``: a refusal, or _TryAgain."""
        fatal = connect_failure(self.address, code, details, self.connection.security.tls)
        return fatal if fatal is not None else _TryAgain(f"{code}: {details}")
