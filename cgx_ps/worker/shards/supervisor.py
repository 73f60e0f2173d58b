"""The half of ``ShardClient`` that repairs its connection: a supervisor task per client.

When the stream breaks, the supervisor reconnects with backoff and carries out what recovery.py
decides (reopen a stream in the same shard instance, or rejoin a restarted one and restore the
last results), then pushes again what is unanswered. Between breaks it watches for a push left
unanswered too long on a connection that looks healthy (a stopped or hung shard).

``ConnectionSupervisor`` is a mixin: it works on the state ``ShardClient`` (client.py) keeps
(the stream's generation, ``_ready`` and ``_broken``, the unanswered pushes and last results)
and uses its stream primitives (``_register``, ``_open_stream``, ``_write``, ``_drop_stream``,
``_fail_all``). It is apart only so that each module holds one job.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from ...v1 import ps_pb2
from ..errors import CgxPsError, ShardUnavailableError
from .recovery import LIVENESS_TIMEOUT_S, Backoff, Rejoin, connect_failure, hung_after_s, is_hung, reconnect_action

__all__ = ["ConnectionSupervisor"]

log = logging.getLogger("cgx_ps.worker.shards.client")  # the client's log: one place to read a connection's story
_WATCH_INTERVAL_S = 0.5  # how often the supervisor looks for a push unanswered too long
_ATTEMPT_TIMEOUT_S = 5.0  # one reconnect attempt's RPCs (a stopped shard accepts TCP but never answers)


class _TryAgain(Exception):
    """A reconnect attempt failed in a way the next attempt may not."""


class ConnectionSupervisor:

    def _stream_broke(self, generation: int, cause: str) -> None:
        if generation != self._generation or self._error is not None or self._closing:
            return
        self._ready.clear()
        self._break_cause = cause
        self._broken.set()

    async def _wait_ready(self) -> None:
        """Until the stream is open and carries every unanswered push (repaired, if it broke)."""
        while not self._ready.is_set():
            if self._error is not None:
                raise self._error
            await asyncio.sleep(0.05)

    def _supervise(self) -> None:
        if self._supervisor is None or self._supervisor.done():
            self._supervisor = asyncio.create_task(self._supervisor_loop())

    async def _supervisor_loop(self) -> None:
        try:
            while self._error is None and not self._closing:
                try:
                    await asyncio.wait_for(self._broken.wait(), _WATCH_INTERVAL_S)
                except asyncio.TimeoutError:
                    await self._check_hung()
                    continue
                self._broken.clear()
                await self._recover(self._break_cause)
        except Exception as exc:  # noqa: BLE001 - a dead supervisor would leave callers waiting forever
            log.exception("shard %s: connection supervisor failed", self.address)
            self._fail_all(CgxPsError(f"shard {self.address}: the connection supervisor failed: {exc!r}"))

    async def _check_hung(self) -> None:
        if not self._ready.is_set() or not self._unanswered:
            return
        (block_id, round_), oldest = next(iter(self._unanswered.items()))  # pushed first: waited longest
        round_timeout = (self.registration.round_timeout_s if self.registration else 0) or 60.0
        waited = time.monotonic() - oldest.since
        if waited <= hung_after_s(round_timeout):
            return
        if not is_hung(waited, round_timeout, await self._answers_status()):
            log.warning("shard %s: no result for block %d round %d in %.1fs, but it answers: slow, not hung",
                        self.address, block_id, round_, waited)
        elif self._unanswered.get((block_id, round_)) is oldest and self._ready.is_set():
            self._fail_all(ShardUnavailableError(
                f"shard {self.address} sent no result for block {block_id} round {round_} in {waited:.1f}s, "
                f"although it fails any round within its round timeout ({round_timeout:g}s): the shard is "
                f"stopped, hung or cut off; check its process and logs"))
            self._drop_stream()

    async def _answers_status(self) -> bool:
        try:
            await self._stub().Status(ps_pb2.StatusRequest(), timeout=LIVENESS_TIMEOUT_S, metadata=self._metadata)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def _recover(self, cause: str) -> None:
        if self.recovery_timeout_s <= 0:
            self._fail_all(ShardUnavailableError(f"shard {self.address} went away ({cause}); recovery is off "
                                                 f"(CGX_PS_RECOVERY_TIMEOUT=0)"))
            return
        started = time.monotonic()
        deadline = started + self.recovery_timeout_s
        log.warning("shard %s: connection lost (%s); reconnecting for up to %gs", self.address, cause,
                    self.recovery_timeout_s)
        self._drop_stream()
        backoff, last = Backoff(), cause
        while self._error is None and not self._closing:
            try:
                how = await self._reconnect(deadline)
            except _TryAgain as exc:
                last = str(exc)
            except CgxPsError as exc:  # a refusal: trying again cannot help
                self._fail_all(exc)
                return
            else:
                took = time.monotonic() - started
                self.recoveries += 1
                self.recovery_s += took
                log.warning("shard %s: %s after %.2fs", self.address, how, took)
                return
            delay = backoff.next()
            if time.monotonic() + delay >= deadline:
                self._fail_all(ShardUnavailableError(
                    f"shard {self.address} did not come back within the recovery timeout of "
                    f"{self.recovery_timeout_s:g}s (CGX_PS_RECOVERY_TIMEOUT): waited {time.monotonic() - started:.1f}s "
                    f"after losing it ({cause}); last error: {last}"))
                return
            await asyncio.sleep(delay)

    async def _reconnect(self, deadline: float) -> str:
        """One attempt: a new channel, then reopen or rejoin, then push again what is unanswered.
        Returns what it did; raises _TryAgain, or a CgxPsError that ends the job."""
        timeout = max(0.2, min(_ATTEMPT_TIMEOUT_S, deadline - time.monotonic()))
        if self._channel is not None:
            await self._channel.close()
        self._channel = self.security.aio_channel(self.address)  # connects now, not after gRPC's backoff
        try:
            status = await self._stub().Status(ps_pb2.StatusRequest(), timeout=timeout, metadata=self._metadata)
            if status.draining:
                raise _TryAgain("the shard is draining for a restart")
            action = reconnect_action(self.registration.instance_id, status.instance_id)
            if isinstance(action, Rejoin):
                await self._register(resume=True, timeout=timeout)
            async with self._write_lock:
                await self._open_stream()
                self._ready.clear()  # until every unanswered push went out again
                restores = list(self._results.items()) if isinstance(action, Rejoin) else []
                for block_id, (round_, result) in restores:
                    await self._write(block_id, round_, result, restore=True)
                again = list(self._unanswered.items())
                for (block_id, round_), entry in again:
                    if (block_id, round_) in self._unanswered:  # its result may have come meanwhile
                        entry.since = time.monotonic()
                        await self._write(block_id, round_, entry.payload)
                self._ready.set()
        except grpc.aio.AioRpcError as exc:
            fatal = connect_failure(self.address, exc.code(), exc.details() or "", self.security.tls)
            if fatal is not None:
                raise fatal from None
            raise _TryAgain(f"{exc.code().name}: {exc.details()}") from None
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            raise _TryAgain(f"the new stream ended at once: {exc}") from None
        what = ("rejoined the restarted shard" if isinstance(action, Rejoin) else "reopened the stream")
        return f"{what}: {len(restores)} result(s) restored, {len(again)} push(es) sent again"
