"""Where gradients are summed: per-block rounds whose pushes are kept, summed and re-quantized once.

Each owned block has its own round counter (rounds/block_state.py). A node's push for (block, round) is validated
and kept in the block's EncodedSum (on the event loop when that is only a check, else on a kernel thread). When
every node has pushed (or, in a quorum round, enough of them: rounds/quorum.py), one fused kernel sums the round's
pushes in arrival order and encodes the sum once with the round's codec (kernels/summation.py), and the same bytes
go to every node. Blocks are independent, so early blocks are returned while later ones are still arriving.

A push costs at most one hop to a kernel thread: the push that completes its round is kept, summed and encoded in
that same hop (py-spy profiles of benchmarks/server.py counted the hops among the shard's larger costs), and a push
whose keeping is only a check (a compressed block of up to 1 MiB that does not complete its round) is kept on the
event loop (threads.keeps_on_loop).

Mixed precision: a non-finite block (an overflowed gradient: the header alone) makes the round's result a non-finite
block too, so every node's loss scaler skips the same step; a sum that overflows from finite pushes still fails the
round.

A push's round decides under the block's lock (block_state.check_round): a node's first push counts, its retry is a
duplicate (or gets the result again), another member of the node's is refused. A *resumed* session (the shard
restarted under a running job) adopts rounds and results from the nodes: rounds/restored.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import Executor
from typing import Callable, Collection

from ...kernels import HEADER_SIZE, Codec, CodecError, EncodedSum, body_size, decode_header
from ...kernels.wire import validate_settings
from ...model_layout import block_payload_size, codec_of
from ...v1 import ps_pb2
from .block_state import (MAX_PENDING_CODEC_CHANGES, MAX_RESUME_ROUND, BlockState, PushOutcome, adoption_conflict,
                          check_header, check_round, prune_schedule, result_seed, resume_conflict)
from ..errors import BadRequest, LimitExceeded, SessionEnded, WrongRound
from ..metrics import ShardMetrics
from .kernel_threads import keeps_on_loop
from .late_rounds import carry_late_push, expected_gradients, fetch_round, quorum_encoder
from .quorum import ClosedRound, QuorumRule, RoundAction, RoundHistory
from .restored import adopt_restored
from .uneven import close_without_gradients, gradients_in, refuse_after_leaving, round_encoding
from .round_outcomes import RoundFailure, RoundSink, RoundSum, encode_round, keep_push

__all__ = ["Aggregator", "MAX_RESUME_ROUND", "PushOutcome", "RoundFailure", "RoundSink", "RoundSum", "result_seed"]

log = logging.getLogger(__name__)


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
        kernel_split: int | None = None,
        quorum: QuorumRule | None = None,
    ) -> None:
        # kernel_split: threads one summing kernel call splits a block over (server/rounds/kernel_threads.py;
        # None: the kernels' default)
        self.blocks = {b.block_id: BlockState(b, block_payload_size(b),
                                              EncodedSum(b.numel, parts=num_nodes, threads=kernel_split),
                                              adopting=resumed, learning=resumed)
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
        self.rule = quorum or QuorumRule(num_nodes)  # quorum rounds (rounds/quorum.py)
        if self.rule.active:
            for block in self.blocks.values():
                block.history = RoundHistory(self.rule.keep_rounds)
        self._closing: set[asyncio.Task] = set()  # rounds closing after their grace
        self._seen: set[str] = set()  # nodes that pushed in time in this session (QuorumRule.after_push)

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
            oldest = block.round - (self.rule.keep_rounds if self.rule.active else 1)  # a push still checked
            block.schedule = prune_schedule(block.schedule, oldest, from_round) + [(from_round, settings)]
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
        return {node for b in self.blocks.values() for node in (*b.pushed, *b.last_pushed)}

    def rounds_in_flight(self) -> int:
        if self.failed is not None:
            return 0  # a failed round will never finish: nothing to wait for
        return sum(1 for b in self.blocks.values() if b.pushed)

    def _block(self, block_id: int) -> BlockState:
        try:
            return self.blocks[block_id]
        except KeyError:
            raise BadRequest(f"block {block_id} is not owned by this shard") from None

    # ---- the hot path ---------------------------------------------------------------------------

    async def push(self, node_id: str, member: int, block_id: int, round_: int, payload: bytes | memoryview
                   ) -> PushOutcome:
        block = self._block(block_id)
        async with block.lock:
            if self.failed is not None:
                raise SessionEnded(f"session failed earlier: {self.failed.message}")
            if not block.adopting:
                return await self._push(block, node_id, member, round_, payload)
            # A resumed session's block takes its round from the first push, but only from one it
            # accepts: a refused push (malformed, or a hostile round id) must change nothing, or it
            # would set the round every other node's pushes are then refused against.
            error = adoption_conflict(block, round_)
            if error is not None:
                raise error
            before = block.round
            block.round, block.adopting = round_, False
            try:
                return await self._push(block, node_id, member, round_, payload)
            except BaseException:
                block.round, block.adopting = before, True
                raise

    async def _push(self, block: BlockState, node_id: str, member: int, round_: int, payload: bytes | memoryview
                    ) -> PushOutcome:
        """A push into ``block`` (its lock held, its round known): check, keep, sum if it completes the round."""
        block_id = block.spec.block_id
        refuse_after_leaving(block, node_id, round_)
        if self.rule.active and (block.history.get(round_) is not None or round_ + 1 < block.round):
            return await carry_late_push(block, node_id, member, round_, payload, self.executor)
        outcome = check_round(block, node_id, member, round_)
        if outcome is not None:
            return outcome
        try:
            header = decode_header(payload)
        except CodecError as exc:
            raise BadRequest(f"block {block_id}: {exc}") from None
        encoding = check_header(block, header)
        # what the round will be once this push is kept (applied below, only if it is)
        stochastic = header.stochastic if block.learning and block.round_encoding is None else block.round_stochastic
        non_finite = block.round_non_finite or header.non_finite  # the result is then a non-finite block
        completes = len(block.pushed) + 1 == self.num_nodes  # check_round: a node's first push
        encode = self._round_encoder(block, round_, encoding, stochastic, non_finite,
                                     len(block.pushed) + 1 - len(block.absent)) if completes else None
        loop = asyncio.get_running_loop()
        arrived = time.monotonic()
        # only checked: kept right here; else one hop to a kernel thread, which also sums a completed round
        try:
            if keeps_on_loop(len(payload), block.sum.keeps(header), completes):
                kept = keep_push(block, round_, node_id, payload, None)
            else:
                kept = await loop.run_in_executor(self.executor, keep_push, block, round_, node_id, payload,
                                                  encode)
        except CodecError as exc:
            raise BadRequest(f"block {block_id} round {round_}: {exc}") from None
        block.round_stochastic = stochastic
        block.round_encoding = encoding
        block.round_non_finite = non_finite
        if self.metrics:
            self.metrics.bytes_in.inc(len(payload))
            if not header.non_finite:
                self.metrics.compression_ratio.set(4 * block.spec.numel / len(payload))
        self._counted(block, node_id, member, round_, kept, arrived)
        return PushOutcome(accepted=True)

    def _counted(self, block: BlockState, node_id: str, member: int, round_: int, kept: RoundSum | None,
                 arrived: float) -> None:
        """A node's push of the round under way is in (``kept``: the round's sum, if it completed it)."""
        loop = asyncio.get_running_loop()
        if not block.pushed:
            block.first_push_at = arrived
            block.timer = loop.call_later(self.round_timeout_s, self._timeout, block, round_)
        block.pushed[node_id] = member
        block.last_rounds[node_id] = round_
        self._seen.add(node_id)
        if kept is not None:
            self._finish(block, round_, kept, arrived)
        elif gradients_in(block, len(block.pushed)) == 0:  # maybe every node leaving: wait for all (uneven.py)
            if len(block.pushed) == self.num_nodes:
                self.sink.everyone_left(block.spec.block_id, round_, close_without_gradients(block))
        elif len(block.pushed) == self.num_nodes:  # completed by a node out of data: sum what it has
            self._grace_over(block, round_)
        elif (action := self._quorum_action(block, round_)) == "close":
            self._grace_over(block, round_)
        elif action == "grace":
            block.grace = loop.call_later(self.rule.grace_s, self._grace_over, block, round_)

    async def out_of_data(self, node_id: str, member: int, block_id: int, round_: int) -> PushOutcome:
        """A push of a node that has run out of data (ps.proto PushChunk.out_of_data; uneven.py): counted, summing
        nothing. A late one (quorum rounds) gets the round's result, as a fetch does, and the round to catch up to."""
        block = self._block(block_id)
        async with block.lock:
            if self.failed is not None:
                raise SessionEnded(f"session failed earlier: {self.failed.message}")
            if self.rule.active and (block.history.get(round_) is not None or round_ + 1 < block.round):
                late = fetch_round(block, self.rule, node_id, member, round_)
                return PushOutcome(accepted=False, resend=late.resend, late_next=block.round)
            outcome = check_round(block, node_id, member, round_)
            if outcome is not None:
                return outcome
            block.absent.add(node_id)
            block.left.setdefault(node_id, round_)
            self._counted(block, node_id, member, round_, None, time.monotonic())
            return PushOutcome(accepted=True)

    async def fetch(self, node_id: str, member: int, block_id: int, round_: int) -> PushOutcome:
        """A late node's fetch of a round's result (ps.proto PushChunk.fetch; late_rounds.py)."""
        block = self._block(block_id)
        async with block.lock:
            if self.failed is not None:
                raise SessionEnded(f"session failed earlier: {self.failed.message}")
            outcome = fetch_round(block, self.rule, node_id, member, round_)
            if round_ == block.round and self._quorum_action(block, round_) == "close":
                self._grace_over(block, round_)  # the round need not wait for a node that skips it
            return outcome

    def _quorum_action(self, block: BlockState, round_: int) -> RoundAction:
        if gradients_in(block, len(block.pushed)) == 0:  # none yet, or every node pushing left: uneven.py
            return "wait"
        return self.rule.after_push(block.pushed, block.last_rounds, round_, len(self._seen), block.fetchers.get(round_, {}))

    def _grace_over(self, block: BlockState, round_: int) -> None:  # or no need to wait (QuorumRule.after_push)
        task = asyncio.ensure_future(self._close_without_the_rest(block, round_))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_without_the_rest(self, block: BlockState, round_: int) -> None:
        """The grace after the quorum's last push is over: close the round with what it has."""
        async with block.lock:
            block.grace = None
            if block.round != round_ or self.failed is not None or not block.pushed:
                return  # closed by its last node meanwhile
            encode = self._round_encoder(block, round_, round_encoding(block, round_), block.round_stochastic,
                                         block.round_non_finite, len(block.pushed) - len(block.absent))
            summed = await asyncio.get_running_loop().run_in_executor(self.executor, encode_round, block,
                                                                      round_, encode)
            self._finish(block, round_, summed, time.monotonic())

    async def restore(self, node_id: str, member: int, block_id: int, round_: int, result: bytes | memoryview
                      ) -> PushOutcome:
        """A node's copy of a round's result from the lost shard instance (resumed sessions only): adopt it
        unless the block is already past that round (module doc)."""
        block = self._block(block_id)
        if not self.resumed:
            raise BadRequest(f"block {block_id}: a result may be restored only into a session resumed after "
                             f"a shard restart (RegisterRequest.resume)")
        async with block.lock:
            if self.failed is not None:
                raise SessionEnded(f"session failed earlier: {self.failed.message}")
            return adopt_restored(block, node_id, round_, result, self.sink)

    def _round_encoder(self, block: BlockState, round_: int, encoding: tuple[int, int, int], stochastic: bool,
                       non_finite: bool, pushed: int) -> Callable[[], memoryview]:
        """How the round's sum is encoded: the way its pushes were (a resumed session's block learns its
        settings, rounding too, from the pushes), seeded by block and round."""
        codec, bits, bucket = encoding
        # A compressed result is encoded into the block's reused buffer (at most ~1/4 of the block's
        # fp32 bytes, at 8 bits); an uncompressed one (warm-up rounds) into a fresh one, let go once
        # framed: a scratch of the block's full size kept besides its accumulator would break the
        # shard's memory rule (server/process/sizing.py)
        scratch = block.result_scratch if codec == Codec.MAXMIN else None
        encode = functools.partial(block.sum.encode, codec, bits=bits, bucket_size=bucket,
                                   stochastic=stochastic if block.learning else block.settings_for(round_).stochastic,
                                   seed=result_seed(block.spec.block_id, round_),
                                   feedback=block.feedback if self.error_feedback else None,
                                   allow_non_finite=non_finite, scratch=scratch)
        if not self.rule.active and not block.absent:
            return lambda: encode().stamped()
        return quorum_encoder(encode, block.sum, list(block.carried), pushed)  # contributors: rounds/quorum.py

    def _finish(self, block: BlockState, round_: int, summed: RoundSum, last_arrived: float) -> None:
        for timer in (block.timer, block.grace):
            if timer is not None:
                timer.cancel()
        if summed.result is None:  # fail loudly, for every node
            self._fail(RoundFailure(block.spec.block_id, round_,
                                    f"aggregate of block {block.spec.block_id} round {round_} "
                                    f"cannot be encoded: {summed.error}", ()))
            return
        block.sum.clear()
        block.last_result = summed.result
        block.last_pushed = block.pushed
        expected = expected_gradients(self.num_nodes, block.left, block.absent)
        block.pushed, block.absent, block.carried, block.grace = {}, set(), [], None
        if block.history is not None:
            block.history.add(ClosedRound(round_, summed.result, dict(block.last_pushed), expected))
        block.round_encoding = None
        block.round_non_finite = False
        block.round += 1
        block.restored, block.summed_here = False, True
        if self.metrics:
            self.metrics.rounds.inc()
            self.metrics.round_latency.observe(time.monotonic() - block.first_push_at)
            self.metrics.last_node_wait.observe(last_arrived - block.first_push_at)
        self.sink.deliver(block.spec.block_id, round_, summed.result,
                          {**block.fetchers.pop(round_, {}), **block.last_pushed})

    def _timeout(self, block: BlockState, round_: int) -> None:
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
            for timer in (b.timer, b.grace):
                if timer is not None:
                    timer.cancel()
        if self.metrics:
            self.metrics.rounds_failed.inc()
        log.error("round failed: %s", failure.message)
        self.sink.round_failed(failure)

    def close(self) -> None:
        for b in self.blocks.values():
            for timer in (b.timer, b.grace):
                if timer is not None:
                    timer.cancel()
