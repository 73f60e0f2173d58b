"""What a late node's push or fetch does to a block of a quorum round (rounds/quorum.py has the
rules): a push of a closed round is carried into the round under way and answered with the
closed round's result; a fetch is answered with a closed round's result at once, or registers
the node for a round not closed yet. The caller (the aggregator) holds the block's lock.

How a late gradient is carried. Round t closed with k of the E gradients it expected and
every node applied their average m_t. Node j's gradient g of round t, late, would have made
that average (k m_t + g) / (k + 1); with every late one, exactly m_t + sum_j (g_j - m_t) / E.
So each late gradient adds (g - m_t) / E to the average of the round under way, whose own
gradients keep their full weight: over the two rounds the nodes apply what they would have
applied had g been in time, one round late. Summing g into the round under way as one more
gradient instead (an average over k' + 1) would take 1 / (k' + 1) of the weight of every
gradient of that round and give it to a stale one: in plain torch, on the task of
benchmarks/stragglers.py with one node 2x slower, that cost +9.5% eval loss at equal steps
against +1.7% this way (``benchmarks/staleness.py``, median of 16 seeds). The shard keeps a late push
until its round under way closes, when the divisor (the gradients in time) is known."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable, Collection

from ... import timeline
from ...kernels import CodecError, EncodedBlock, EncodedSum, check_payload, decode_header, set_contributors
from ..errors import BadRequest, WrongRound
from .block_state import BlockState, PushOutcome
from .quorum import ClosedRound, QuorumRule

__all__ = ["CarriedPush", "add_late_corrections", "carry_late_push", "correction_weights", "expected_gradients",
           "fetch_round", "quorum_encoder", "result_divisor"]


@dataclass(frozen=True)
class CarriedPush:
    """A late push kept for the round under way, and the closed round it was computed for."""

    payload: bytes | memoryview
    closed: ClosedRound


def expected_gradients(num_nodes: int, left: Collection[str], absent: Collection[str]) -> int:
    """The gradients a round would have averaged had every node still in its rounds pushed in
    time: not those that left (out of data) before or in it (rounds/uneven.py)."""
    return max(1, num_nodes - len(set(left) | set(absent)))


def result_divisor(in_time: int, carried: int) -> int:
    """What a round's result says it averages (its contributors): its gradients in time; 1 for a
    round that has only late gradients' corrections (every node in time left it)."""
    return in_time if in_time or not carried else 1


def correction_weights(divisor: int, expected: int, closed_contributors: int) -> tuple[float, float]:
    """The weights, in the sum of a round whose nodes divide by ``divisor``, of a late gradient
    and of the result of the round it was late for (a sum of ``closed_contributors`` gradients,
    ``expected`` expected): divisor (g - m_t) / expected, with m_t that result / its contributors
    (module doc)."""
    weight = divisor / expected
    return weight, -weight / closed_contributors


def add_late_corrections(total: EncodedSum, carried: list[CarriedPush], divisor: int) -> None:
    """On a kernel thread, before the round under way is encoded: each carried push's correction
    added into its sum (module doc)."""
    closed_rounds: dict[int, ClosedRound] = {p.closed.round: p.closed for p in carried}
    weights = {r: correction_weights(divisor, c.expected, decode_header(c.result.payload).contributors)
               for r, c in closed_rounds.items()}  # (each late gradient's, its round's result's) per round
    result_weights = dict.fromkeys(closed_rounds, 0.0)  # summed over the round's carried pushes
    for push in carried:
        weight, mean_weight = weights[push.closed.round]
        total.add_scaled(push.payload, weight)
        result_weights[push.closed.round] += mean_weight
    for round_, closed in closed_rounds.items():  # each closed round's result decoded once
        total.add_scaled(closed.result.payload, result_weights[round_])


def quorum_encoder(encode: Callable[[], EncodedBlock], total: EncodedSum, carried: list[CarriedPush],
                   in_time: int) -> Callable[[], memoryview]:
    """How a quorum round (or one a node left) is encoded on a kernel thread: the late pushes'
    corrections added to ``total``, then ``encode``, stamped with what the nodes divide by."""
    divisor = result_divisor(in_time, len(carried))

    def stamped_with_contributors() -> memoryview:
        add_late_corrections(total, carried, divisor)
        result = encode().stamped()
        set_contributors(result, divisor)
        return result

    return stamped_with_contributors


async def carry_late_push(block: BlockState, node_id: str, member: int, round_: int, payload: bytes | memoryview,
                          executor: Executor | None) -> PushOutcome:
    """A push of ``round_``, closed without it: the round's result, and the push's gradient
    summed into the round under way (a retry of one carried already gets the result alone).
    Raises BadRequest for a malformed payload (nothing carried), WrongRound for a round no
    longer kept."""
    late = block.history.late_outcome(block.spec.block_id, block.round, node_id, member, round_)
    if not late.carry:
        return PushOutcome(accepted=False, resend=late.result)
    try:
        header = decode_header(payload)
        if header.numel != block.spec.numel:
            raise CodecError(f"{header.numel} elements, the block has {block.spec.numel}")
        # an overflowed gradient is skipped by its scaler, and a round every node's scaler skipped (its
        # result not finite) applied none of its gradients: nothing to carry, nothing to correct
        if not header.non_finite and not decode_header(late.result.payload).non_finite:
            # on the timeline under the round it is carried into, naming the round it was late for
            with timeline.span("carry", block.round, block=block.spec.block_id, node=node_id, late_round=round_):
                await asyncio.get_running_loop().run_in_executor(executor, check_payload, payload)
            # kept until the round closes (a buffer its owner could reuse is copied: kernels/summation.py)
            kept = payload if memoryview(payload).readonly else bytes(payload)
            block.carried.append(CarriedPush(kept, late.closed))
    except CodecError as exc:
        raise BadRequest(f"block {block.spec.block_id} round {round_}: {exc}") from None
    late.closed.late[node_id] = member
    block.last_rounds[node_id] = max(round_, block.last_rounds.get(node_id, round_))
    return PushOutcome(accepted=True, resend=late.result, late_next=block.round)


def fetch_round(block: BlockState, rule: QuorumRule, node_id: str, member: int, round_: int) -> PushOutcome:
    """A late node's fetch of ``round_``: a closed round's result at once; a round not closed yet
    is sent to the node's stream when it closes (the aggregator's ``_finish``). Raises
    BadRequest outside quorum rounds, WrongRound for a round not kept or too far ahead."""
    block_id = block.spec.block_id
    if not rule.active:
        raise BadRequest(f"block {block_id}: a fetch is for quorum rounds only (CGX_PS_QUORUM)")
    if round_ < block.round:
        late = block.history.late_outcome(block_id, block.round, node_id, member, round_, fetch=True)
        return PushOutcome(accepted=False, resend=late.result)
    if round_ - block.round >= rule.keep_rounds:
        raise WrongRound(f"block {block_id}: cannot fetch round {round_}, the block is at round {block.round}")
    block.fetchers.setdefault(round_, {})[node_id] = member
    return PushOutcome(accepted=False)
