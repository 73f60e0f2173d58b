"""Where gradients are summed: per-block rounds of dequantize-accumulate, then one re-quantize.

Each owned block has its own round counter. A node's push for (block, round) is decoded straight
into the block's float32 accumulator (the first push overwrites, later ones add), on a kernel
thread so the event loop keeps receiving. When every node has pushed, the sum is encoded once
with the block's codec and the same bytes go to every node: the sink (the session) hears the
result with the member of each node that pushed it. Blocks are independent, so early blocks are
returned while later ones are still arriving.

Mixed precision: a node whose gradient overflowed pushes a non-finite block (the header alone,
``FLAG_NONFINITE``). It is validated like any push (header, exact size, crc), decodes as NaN
into the sum, and makes the round's result a non-finite block too, so every node sees the
overflow and its loss scaler skips the same step. Only a flagged push does that: a sum that
overflows from finite pushes still fails the round.

A block records who pushed it (node -> member) for the round under way and the one before, and
decides under its lock: a node's first push counts, its retry is a duplicate (or, for the round
just finished, gets the result again), and another member of the same node is refused: one
local rank pushes each block.

A *resumed* session (the shard restarted under a running job: ps.proto, RegisterRequest.resume)
knows neither the blocks' rounds nor the codec settings announced to the lost instance. Each
block takes its round from the first push or restored result it gets, and the encoding of each
round from that round's first push. A node that saw a round finish before the restart sends its
result back (``restore``): the block adopts those bytes instead of summing the round again, and
the nodes still waiting for that round get exactly them, so every replica applies the same
update and none applies a step twice.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Collection, Mapping, Protocol

import torch

from .. import timeline
from ..kernels import (HEADER_SIZE, Codec, CodecError, ErrorFeedback, body_size, decode_header, dequantize,
                       encode_block)
from ..kernels.wire import validate_settings
from ..layout import block_payload_size, codec_of
from ..v1 import ps_pb2
from .errors import BadRequest, Conflict, LimitExceeded, ProtocolError, SessionEnded, WrongRound
from .metrics import ShardMetrics

__all__ = ["Aggregator", "MAX_RESUME_ROUND", "PushOutcome", "RoundFailure", "RoundSink", "result_seed"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundFailure:
    block_id: int
    round: int
    message: str
    missing_nodes: tuple[str, ...]


class RoundSink(Protocol):
    """Who hears of finished and failed rounds (the session)."""

    def deliver(self, block_id: int, round_: int, result: bytes, pushers: Mapping[str, int]) -> None:
        """``result`` of a round, for each node's member in ``pushers`` (node id -> member)."""

    def round_failed(self, failure: RoundFailure) -> None: ...


@dataclass(frozen=True)
class PushOutcome:
    accepted: bool  # False: a duplicate, ignored
    resend: bytes | None = None  # a retry of the round just finished: its result again


@dataclass(eq=False)
class _Block:
    spec: ps_pb2.BlockSpec
    payload_size: int
    round: int = 0
    acc: torch.Tensor | None = None
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)  # server-side error feedback's residual
    pushed: dict[str, int] = field(default_factory=dict)  # node -> member, this round
    first_push_at: float = 0.0
    timer: asyncio.TimerHandle | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_result: bytes | None = None  # result of round - 1, for retried pushes
    last_pushed: Mapping[str, int] = field(default_factory=dict)  # node -> member, round - 1
    round_encoding: tuple[int, int, int] | None = None  # (codec, bits, bucket) of this round
    round_non_finite: bool = False  # a node pushed a non-finite block this round: the result is one
    # adaptive compression: (from_round, settings) announced with SetCodecs, ascending
    schedule: list[tuple[int, ps_pb2.CodecSettings]] = field(default_factory=list)
    # resumed sessions (module doc): the round comes from the first push or restored result; the
    # encoding from each round's first push (and its stochastic flag, for the re-quantization)
    adopting: bool = False
    learning: bool = False
    round_stochastic: bool = False
    # the last result was restored, not summed here: nodes absent from last_pushed get it too
    restored: bool = False
    summed_here: bool = False  # a round was summed here: a restore now comes too late
    resumed_at: int | None = None  # the checkpoint round the session resumed this block at

    @property
    def pristine(self) -> bool:
        """Nothing pushed in this session yet (a resume may still move its first round)."""
        return self.round == 0 and not self.pushed and self.last_result is None

    def settings_for(self, round_: int) -> ps_pb2.CodecSettings:
        current = self.spec.codec
        for start, settings in self.schedule:
            if start <= round_:
                current = settings
        return current


# Bounded memory: a client announcing a change for every future round must not grow the schedule.
MAX_PENDING_CODEC_CHANGES = 8


def _prune_schedule(schedule: list[tuple[int, ps_pb2.CodecSettings]], current_round: int,
                    from_round: int) -> list[tuple[int, ps_pb2.CodecSettings]]:
    """The entries still needed before ``from_round``: of those that started by the previous
    round (a retried push of it is still checked against its settings) only the latest."""
    kept = [(r, c) for r, c in schedule if r < from_round]
    past = [e for e in kept if e[0] <= current_round - 1]
    return past[-1:] + [e for e in kept if e[0] > current_round - 1]


# Rounds a resume may start at: the seeds shift rounds by 24 bits below bit 62 (result_seed).
MAX_RESUME_ROUND = 1 << 32


def resume_conflict(block: _Block, from_round: int, settings: ps_pb2.CodecSettings) -> ProtocolError | None:
    """Why a block may not resume at ``from_round`` with ``settings``; None if it may (a repeat
    of the same resume by another worker included)."""
    block_id = block.spec.block_id
    if from_round >= MAX_RESUME_ROUND:
        return BadRequest(f"block {block_id}: cannot resume at round {from_round} (limit {MAX_RESUME_ROUND})")
    if block.resumed_at is not None:
        if block.resumed_at != from_round:
            return Conflict(f"block {block_id}: another worker resumed it at round {block.resumed_at}, this one at "
                            f"{from_round}: every worker must load the checkpoint of the same step")
        if block.settings_for(from_round) != settings:
            return Conflict(f"block {block_id}: another worker resumed it at round {from_round} with other codec "
                            f"settings: every worker must load the checkpoint of the same step")
        return None
    if not block.pristine:
        return WrongRound(f"block {block_id}: cannot resume at round {from_round}, this session already runs round "
                          f"{block.round}: load the checkpoint before the first step")
    return None


def result_seed(block_id: int, round_: int) -> int:
    # Distinct from any worker seed stream, deterministic, different every round.
    return (1 << 62) | (round_ << 24) | block_id


class Aggregator:
    def __init__(
        self,
        blocks: list[ps_pb2.BlockSpec],
        num_nodes: int,
        executor: Executor | None,
        sink: RoundSink,
        registered: Collection[str],
        round_timeout_s: float,
        error_feedback: bool = False,
        metrics: ShardMetrics | None = None,
        resumed: bool = False,
    ) -> None:
        self.blocks = {b.block_id: _Block(b, block_payload_size(b), adopting=resumed, learning=resumed)
                       for b in blocks}
        self.resumed = resumed
        self.num_nodes = num_nodes
        self.executor = executor
        self.sink = sink
        self.registered = registered  # node ids registered so far (a live view): named on timeouts
        self.round_timeout_s = round_timeout_s
        self.error_feedback = error_feedback
        self.metrics = metrics
        self.failed: RoundFailure | None = None

    # ---- queries used by the service ----------------------------------------------------------

    def allowed_sizes(self, block_id: int, round_: int) -> tuple[int, ...] | range:
        """Wire sizes a push of this block may have in a round: its codec then, uncompressed, or
        a non-finite block (the header alone); a resumed session's block, which learns its
        encoding from the pushes, takes any size up to uncompressed."""
        block = self._block(block_id)
        if block.learning:
            return range(HEADER_SIZE, HEADER_SIZE + 4 * block.spec.numel + 1)
        s = block.settings_for(round_)
        size = HEADER_SIZE + body_size(codec_of(s), block.spec.numel, s.bits, s.bucket_size)
        return size, HEADER_SIZE + 4 * block.spec.numel, HEADER_SIZE  # the last: a non-finite block

    def set_codecs(self, from_round: int, changes: list[tuple[int, ps_pb2.CodecSettings]]) -> None:
        """Schedule new settings for blocks from a round on (all or none are applied)."""
        for block_id, settings in changes:
            block = self._block(block_id)
            started = block.round + (1 if block.pushed else 0)
            if from_round < started:
                raise WrongRound(f"block {block_id}: cannot change settings from round {from_round}, "
                                 f"round {started - 1} is already under way")
            if sum(1 for r, _ in block.schedule if block.round < r < from_round) >= MAX_PENDING_CODEC_CHANGES:
                raise LimitExceeded(f"block {block_id}: {MAX_PENDING_CODEC_CHANGES} codec changes are already "
                                    f"scheduled for future rounds")
            try:
                validate_settings(codec_of(settings), settings.bits, settings.bucket_size)
            except (CodecError, ValueError) as exc:
                raise BadRequest(f"block {block_id}: {exc}") from None
        for block_id, settings in changes:
            block = self.blocks[block_id]
            block.schedule = _prune_schedule(block.schedule, block.round, from_round) + [(from_round, settings)]
            if self.metrics:
                self.metrics.block_bits.labels(shard=self.metrics.shard, block=str(block_id)).set(
                    settings.bits if settings.codec == ps_pb2.CODEC_MAXMIN else 32)

    def resume(self, from_round: int, changes: list[tuple[int, ps_pb2.CodecSettings]]) -> None:
        """The job resumes from a checkpoint: these blocks start at ``from_round`` with these
        settings (all or none). Only blocks not yet pushed in this session; a repeat is a no-op."""
        for block_id, settings in changes:
            try:
                validate_settings(codec_of(settings), settings.bits, settings.bucket_size)
            except (CodecError, ValueError) as exc:
                raise BadRequest(f"block {block_id}: {exc}") from None
            error = resume_conflict(self._block(block_id), from_round, settings)
            if error is not None:
                raise error
        for block_id, settings in changes:
            block = self.blocks[block_id]
            if block.resumed_at is None:
                block.round, block.resumed_at, block.schedule = from_round, from_round, [(from_round, settings)]

    def next_round(self, block_id: int) -> int:
        return self._block(block_id).round

    def opens_round(self, block_id: int, round_: int) -> bool:
        """Would a push of this block and round be the round's first?"""
        block = self._block(block_id)
        return block.round == round_ and not block.pushed

    def pushed_nodes(self) -> set[str]:
        """Nodes that have pushed anything in this session."""
        nodes = set()
        for b in self.blocks.values():
            nodes.update(b.pushed, b.last_pushed)
        return nodes

    def rounds_in_flight(self) -> int:
        if self.failed is not None:
            return 0  # a failed round will never finish: nothing to wait for
        return sum(1 for b in self.blocks.values() if b.pushed)

    def _block(self, block_id: int) -> _Block:
        try:
            return self.blocks[block_id]
        except KeyError:
            raise BadRequest(f"block {block_id} is not owned by this shard") from None

    # ---- the hot path ---------------------------------------------------------------------------

    async def push(self, node_id: str, member: int, block_id: int, round_: int, payload: bytes | memoryview
                   ) -> PushOutcome:
        block = self._block(block_id)
        async with block.lock:
            if block.adopting:  # resumed session: the first push says where the block is
                block.round, block.adopting = round_, False
            outcome = self._check_round(block, node_id, member, round_)
            if outcome is not None:
                return outcome
            encoding = self._check_header(block, payload)
            loop = asyncio.get_running_loop()
            first = not block.pushed
            if block.acc is None:
                block.acc = torch.empty(block.spec.numel, dtype=torch.float32)
            decode = timeline.wrapped(functools.partial(dequantize, payload, out=block.acc, accumulate=not first),
                                      "sum", round_, block=block_id, node=node_id)
            try:
                await loop.run_in_executor(self.executor, decode)
            except CodecError as exc:
                raise BadRequest(f"block {block_id} round {round_}: {exc}") from None
            if first:
                block.first_push_at = time.monotonic()
                block.timer = loop.call_later(self.round_timeout_s, self._timeout, block, round_)
            block.pushed[node_id] = member
            block.round_encoding = encoding
            non_finite = decode_header(payload).non_finite  # checked above; decoded into the sum as NaN
            block.round_non_finite |= non_finite
            if self.metrics:
                self.metrics.bytes_in.inc(len(payload))
                if not non_finite:
                    self.metrics.compression_ratio.set(4 * block.spec.numel / len(payload))
            if len(block.pushed) == self.num_nodes:
                await self._finish(block, round_)
            return PushOutcome(accepted=True)

    async def restore(self, node_id: str, member: int, block_id: int, round_: int, result: bytes) -> PushOutcome:
        """A node's copy of a round's result from the lost shard instance (resumed sessions only):
        adopt it unless the block is already past that round (module doc)."""
        block = self._block(block_id)
        if not self.resumed:
            raise BadRequest(f"block {block_id}: a result may be restored only into a session resumed after "
                             f"a shard restart (RegisterRequest.resume)")
        async with block.lock:
            if self.failed is not None:
                raise SessionEnded(f"session failed earlier: {self.failed.message}")
            if not block.adopting and round_ < block.round:
                return PushOutcome(accepted=False)  # another node restored it first, or it is older
            if not block.adopting and (round_ > block.round or block.summed_here):
                raise WrongRound(f"block {block_id}: cannot restore round {round_}, the block is at round "
                                 f"{block.round}{' and has summed rounds since the restart' if block.summed_here else ''}")
            self._check_result(block, result)
            waiting = block.pushed  # nodes that pushed this round here: they get the restored bytes
            if block.timer is not None:
                block.timer.cancel()
            block.last_result, block.last_pushed, block.pushed = result, waiting, {}
            block.round, block.adopting, block.restored, block.round_encoding = round_ + 1, False, True, None
            log.info("block %d: round %d restored from node %s (%d node(s) were waiting for it)", block_id, round_,
                     node_id, len(waiting))
            if waiting:
                self.sink.deliver(block_id, round_, result, waiting)
            return PushOutcome(accepted=True)

    def _check_result(self, block: _Block, result: bytes) -> None:
        """A restored result must be a well-formed block of the right size (it is decoded by every
        node that receives it, so the codec checks everything else there)."""
        try:
            h = decode_header(result)
        except CodecError as exc:
            raise BadRequest(f"block {block.spec.block_id}: restored result: {exc}") from None
        if h.numel != block.spec.numel:
            raise BadRequest(f"block {block.spec.block_id}: restored result has {h.numel} elements, the block "
                             f"{block.spec.numel}")

    def _check_round(self, block: _Block, node_id: str, member: int, round_: int) -> PushOutcome | None:
        """None for a push that counts, an outcome for a retry; raises for one that may not."""
        if self.failed is not None:
            raise SessionEnded(f"session failed earlier: {self.failed.message}")
        if round_ == block.round:
            by = block.pushed.get(node_id)
        elif round_ + 1 == block.round:
            by = block.last_pushed.get(node_id)
        else:
            by = None
        if by is not None and by != member:
            raise BadRequest(f"block {block.spec.block_id} round {round_} was already pushed by member {by} of "
                             f"node {node_id}: one local rank pushes each block")
        if by is not None:
            # a retry: of a push already summed (the result goes to the member's stream as it is
            # then), or of the round just finished (its result again)
            return PushOutcome(accepted=False, resend=None if round_ == block.round else block.last_result)
        if round_ == block.round:
            return None
        if round_ + 1 == block.round and block.restored:
            # a node that pushed the round before the restart: the restored result is its result
            return PushOutcome(accepted=False, resend=block.last_result)
        kind = "stale" if round_ < block.round else "far-future"
        raise WrongRound(f"block {block.spec.block_id}: {kind} round {round_}, the shard expects round {block.round}")

    def _check_header(self, block: _Block, payload: bytes | memoryview) -> tuple[int, int, int]:
        """The push's (codec, bits, bucket): the declared one or FP32, and the round's."""
        spec = block.spec
        try:
            h = decode_header(payload)
        except CodecError as exc:
            raise BadRequest(f"block {spec.block_id}: {exc}") from None
        settings = block.settings_for(block.round)
        codec = codec_of(settings)
        declared = (int(codec), settings.bits, settings.bucket_size) if codec == Codec.MAXMIN \
            else (int(codec), h.bits, 0)
        got = (int(h.codec), h.bits, h.bucket_size)
        if block.learning:  # resumed session: the round's first push says how the round travels
            declared = block.round_encoding or got
            if block.round_encoding is None:
                block.round_stochastic = h.stochastic
        if h.numel != spec.numel or got not in (declared, (int(Codec.FP32), 32, 0)):
            raise BadRequest(
                f"block {spec.block_id}: payload is {h.codec.name} bits={h.bits} bucket={h.bucket_size} "
                f"numel={h.numel}; round {block.round} expects {codec.name} bits={settings.bits} "
                f"bucket={settings.bucket_size} numel={spec.numel} (or FP32)",
            )
        if block.round_encoding is not None and got != block.round_encoding:
            c, b, k = block.round_encoding
            raise BadRequest(
                f"block {spec.block_id} round {block.round}: other nodes pushed {Codec(c).name} bits={b} "
                f"bucket={k}, this push is {h.codec.name} bits={h.bits} bucket={h.bucket_size}")
        return got

    async def _finish(self, block: _Block, round_: int) -> None:
        if block.timer is not None:
            block.timer.cancel()
        loop = asyncio.get_running_loop()
        wait = time.monotonic() - block.first_push_at
        try:
            result = await loop.run_in_executor(self.executor, timeline.wrapped(
                self._encode_sum, "re-encode", round_, block=block.spec.block_id), block, round_)
        except CodecError as exc:
            # One node sent huge finite values: the sum is not encodable. Fail loudly for all.
            self._fail(RoundFailure(block.spec.block_id, round_,
                                    f"aggregate of block {block.spec.block_id} round {round_} "
                                    f"cannot be encoded: {exc}", ()))
            return
        block.last_result = result
        block.last_pushed = block.pushed
        block.pushed = {}
        block.round_encoding = None
        block.round_non_finite = False
        block.round += 1
        block.restored, block.summed_here = False, True
        if self.metrics:
            self.metrics.rounds.inc()
            self.metrics.round_latency.observe(time.monotonic() - block.first_push_at)
            self.metrics.last_node_wait.observe(wait)
        self.sink.deliver(block.spec.block_id, round_, result, block.last_pushed)

    def _encode_sum(self, block: _Block, round_: int) -> bytes:
        """Encode the round's sum the way the round's pushes were encoded."""
        assert block.acc is not None and block.round_encoding is not None
        codec, bits, bucket = block.round_encoding
        acc, seed = block.acc, result_seed(block.spec.block_id, round_)
        stochastic = block.round_stochastic if block.learning else block.settings_for(round_).stochastic
        return encode_block(acc, codec, bits=bits, bucket_size=bucket, stochastic=stochastic, seed=seed,
                            feedback=block.feedback if self.error_feedback else None,
                            allow_non_finite=block.round_non_finite).to_bytes()

    # ---- failure --------------------------------------------------------------------------------

    def _timeout(self, block: _Block, round_: int) -> None:
        if block.round != round_ or self.failed is not None:
            return
        registered = set(self.registered)
        missing = sorted(registered - block.pushed.keys())
        never = self.num_nodes - len(registered)
        who = ", ".join(missing) if missing else "none of the registered nodes"
        extra = (f" and {never} of {self.num_nodes} node(s) that never registered with this shard (registered: "
                 f"{', '.join(sorted(registered)) or 'none'})") if never > 0 else ""
        self._fail(RoundFailure(
            block.spec.block_id, round_,
            f"round {round_} of block {block.spec.block_id} timed out after {self.round_timeout_s:g}s "
            f"waiting for node(s): {who}{extra}",
            tuple(missing),
        ))

    def _fail(self, failure: RoundFailure) -> None:
        if self.failed is not None:
            return
        self.failed = failure
        for b in self.blocks.values():
            if b.timer is not None:
                b.timer.cancel()
        if self.metrics:
            self.metrics.rounds_failed.inc()
        log.error("round failed: %s", failure.message)
        self.sink.round_failed(failure)

    def close(self) -> None:
        for b in self.blocks.values():
            if b.timer is not None:
                b.timer.cancel()
