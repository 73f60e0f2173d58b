"""One owned block's round state, and the decisions the aggregator takes on it as small functions.

A block records who pushed it (node -> member) for the round under way and the one before, and
the pushes of the round under way in an EncodedSum (kernels/summation.py). ``check_round`` says
what a push of (node, member, round) is: one that counts, a retry (an outcome), or one refused
(an error); ``check_header`` whether its encoding fits the round; ``resume_conflict`` whether a
block may resume from a checkpoint round. None of them changes the block.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ...kernels import Codec, CodecError, EncodedSum, ErrorFeedback, Header, PayloadScratch, decode_header
from ...model_layout import codec_of
from ...v1 import ps_pb2
from ..errors import BadRequest, Conflict, ProtocolError, WrongRound
from ..rpc.push_frames import ResultFrames
from .quorum import RoundHistory

if TYPE_CHECKING:
    from .late_rounds import CarriedPush

__all__ = ["BlockState", "MAX_PENDING_CODEC_CHANGES", "MAX_RESUME_ROUND", "PushOutcome", "adoption_conflict",
           "check_header", "check_result", "check_round", "prune_schedule", "result_seed", "resume_conflict"]

# Bounded memory: a client announcing a change for every future round must not grow the schedule.
MAX_PENDING_CODEC_CHANGES = 8

# Rounds a resume may start at: the seeds shift rounds by 24 bits below bit 62 (result_seed).
MAX_RESUME_ROUND = 1 << 32


@dataclass(frozen=True)
class PushOutcome:
    accepted: bool  # False: a duplicate, ignored
    resend: ResultFrames | None = None  # a retry of the round just finished: its result again
    # quorum rounds (rounds/quorum.py): the push came after its round closed, and the block is now
    # at this round (the node is told, then gets ``resend``)
    late_next: int | None = None


@dataclass(eq=False)
class BlockState:
    spec: ps_pb2.BlockSpec
    payload_size: int
    sum: EncodedSum  # the pushes of the round under way, summed once all have come
    round: int = 0
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)  # server-side error feedback's residual
    # where a max-min result is encoded, round after round (aggregator._round_encoder): its memory
    # is not allocated and faulted in afresh each round; the result leaves it framed (a copy)
    result_scratch: PayloadScratch = field(default_factory=PayloadScratch)
    pushed: dict[str, int] = field(default_factory=dict)  # node -> member, this round
    first_push_at: float = 0.0
    timer: asyncio.TimerHandle | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_result: ResultFrames | None = None  # result of round - 1, for retried pushes
    last_pushed: Mapping[str, int] = field(default_factory=dict)  # node -> member, round - 1
    round_encoding: tuple[int, int, int] | None = None  # (codec, bits, bucket) of this round
    round_non_finite: bool = False  # a node pushed a non-finite block this round: the result is one
    # adaptive compression: (from_round, settings) announced with SetCodecs, ascending
    schedule: list[tuple[int, ps_pb2.CodecSettings]] = field(default_factory=list)
    # resumed sessions (aggregator.py): the round comes from the first push or restored result; the
    # encoding from each round's first push (and its stochastic flag, for the re-quantization)
    adopting: bool = False
    learning: bool = False
    round_stochastic: bool = False
    # the last result was restored, not summed here: nodes absent from last_pushed get it too
    restored: bool = False
    summed_here: bool = False  # a round was summed here: a restore now comes too late
    resumed_at: int | None = None  # the checkpoint round the session resumed this block at
    # quorum rounds (rounds/quorum.py): late pushes carried into this round (late_rounds.py), the
    # timer that closes it without the slowest nodes, the closed rounds late nodes may still need,
    # and the nodes that fetch a round not closed yet (round -> node -> member)
    carried: list["CarriedPush"] = field(default_factory=list)
    last_rounds: dict[str, int] = field(default_factory=dict)  # node -> its latest round pushed, in time or late
    grace: asyncio.TimerHandle | None = None
    history: RoundHistory | None = None
    fetchers: dict[int, dict[str, int]] = field(default_factory=dict)
    # uneven inputs (rounds/uneven.py): nodes that pushed this round out of data, and the nodes
    # that left the block's rounds (node -> the round it left at) until every node has
    absent: set[str] = field(default_factory=set)
    left: dict[str, int] = field(default_factory=dict)

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


def prune_schedule(schedule: list[tuple[int, ps_pb2.CodecSettings]], oldest: int,
                   from_round: int) -> list[tuple[int, ps_pb2.CodecSettings]]:
    """The entries still needed before ``from_round``: of those that started by ``oldest``, the
    oldest round a push may still be checked against, only the latest. That is the previous
    round (a retried push of it), or under quorum rounds the oldest closed round kept for late
    nodes: a late push travels with its own round's settings, however many changes came since
    (rounds/late_rounds.py). The schedule stays bounded: one entry per round from ``oldest``."""
    kept = [(r, c) for r, c in schedule if r < from_round]
    past = [e for e in kept if e[0] <= oldest]
    return past[-1:] + [e for e in kept if e[0] > oldest]


def resume_conflict(block: BlockState, from_round: int, settings: ps_pb2.CodecSettings) -> ProtocolError | None:
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


def adoption_conflict(block: BlockState, round_: int) -> ProtocolError | None:
    """Why a resumed session's block, which takes its round from the first push or restored
    result it gets (aggregator.py), may not take ``round_``; None if it may. The bound is a
    resume's: past it the round ids would overflow the uint64 ``next_rounds`` every later
    Register answers with, so one member's push would break every node's Register."""
    if round_ >= MAX_RESUME_ROUND:
        return BadRequest(f"block {block.spec.block_id}: cannot take round {round_} from a push into a resumed "
                          f"session (limit {MAX_RESUME_ROUND})")
    return None


def result_seed(block_id: int, round_: int) -> int:
    # Distinct from any worker seed stream, deterministic, different every round.
    return (1 << 62) | (round_ << 24) | block_id


def check_round(block: BlockState, node_id: str, member: int, round_: int) -> PushOutcome | None:
    """None for a push that counts, an outcome for a retry; raises for one that may not."""
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


def check_header(block: BlockState, h: Header) -> tuple[int, int, int]:
    """The push's (codec, bits, bucket): the declared one or FP32, and the round's; a resumed
    session's block takes the round's encoding from its first push."""
    spec = block.spec
    settings = block.settings_for(block.round)
    codec = codec_of(settings)
    declared = (int(codec), settings.bits, settings.bucket_size) if codec == Codec.MAXMIN \
        else (int(codec), h.bits, 0)
    got = (int(h.codec), h.bits, h.bucket_size)
    if block.learning:  # resumed session: the round's first push says how the round travels
        declared = block.round_encoding or got
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


def check_result(block: BlockState, result: bytes | memoryview) -> None:
    """A restored result must be a well-formed block of the right size (it is decoded by every
    node that receives it, so the codec checks everything else there)."""
    try:
        h = decode_header(result)
    except CodecError as exc:
        raise BadRequest(f"block {block.spec.block_id}: restored result: {exc}") from None
    if h.numel != block.spec.numel:
        raise BadRequest(f"block {block.spec.block_id}: restored result has {h.numel} elements, the block "
                         f"{block.spec.numel}")
