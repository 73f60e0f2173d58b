"""What a late node's push or fetch does to a block of a quorum round (rounds/quorum.py has the
rules): a push of a closed round is carried into the round under way and answered with the
closed round's result; a fetch is answered with a closed round's result at once, or registers
the node for a round not closed yet. The caller (the aggregator) holds the block's lock."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from ... import timeline
from ...kernels import CodecError, decode_header
from ..errors import BadRequest, WrongRound
from .block_state import BlockState, PushOutcome
from .quorum import QuorumRule

__all__ = ["carry_late_push", "fetch_round"]


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
        if not header.non_finite:  # an overflowed gradient is skipped by its scaler: nothing to carry
            # on the timeline under the round it is summed into, naming the round it was late for
            with timeline.span("carry", block.round, block=block.spec.block_id, node=node_id, late_round=round_):
                await asyncio.get_running_loop().run_in_executor(executor, block.sum.add, payload)
            block.carried += 1
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
