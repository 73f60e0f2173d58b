"""A resumed session's blocks (ps.proto RegisterRequest.resume): the shard restarted under a running
job, and a node's copy of a round's result from the lost instance becomes the round's result.

A *resumed* session (the shard restarted under a running job: ps.proto, RegisterRequest.resume)
knows neither the blocks' rounds nor the codec settings announced to the lost instance. Each
block takes its round from the first push or restored result it accepts (a refused one changes
nothing, and none beyond ``MAX_RESUME_ROUND`` is taken), and the encoding of each round from that
round's first push. A node that saw a round finish before the restart sends its
result back (``restore``): the block adopts those bytes instead of summing the round again, and
the nodes still waiting for that round get exactly them, so every replica applies the same
update and none applies a step twice.
"""

from __future__ import annotations

import logging

from ..errors import WrongRound
from ..rpc.push_frames import ResultFrames
from .block_state import BlockState, PushOutcome, adoption_conflict, check_result
from .round_outcomes import RoundSink

__all__ = ["adopt_restored"]

log = logging.getLogger("cgx_ps.server.rounds.aggregator")  # the aggregator's story, in one log


def adopt_restored(block: BlockState, node_id: str, round_: int, result: bytes | memoryview,
                   sink: RoundSink) -> PushOutcome:
    """Adopt ``result`` as the block's round ``round_`` unless the block is already past that round;
    the nodes that pushed it here get these bytes. The caller holds the block's lock. Raises
    WrongRound (or a resume's conflict) for a round the block cannot take."""
    block_id = block.spec.block_id
    error = adoption_conflict(block, round_) if block.adopting else None
    if error is not None:
        raise error
    if not block.adopting and round_ < block.round:
        return PushOutcome(accepted=False)  # another node restored it first, or it is older
    if not block.adopting and (round_ > block.round or block.summed_here):
        raise WrongRound(f"block {block_id}: cannot restore round {round_}, the block is at round "
                         f"{block.round}{' and has summed rounds since the restart' if block.summed_here else ''}")
    check_result(block, result)
    framed = ResultFrames.of(block_id, round_, result)
    waiting = block.pushed  # nodes that pushed this round here: they get the restored bytes
    if block.timer is not None:
        block.timer.cancel()
    block.last_result, block.last_pushed, block.pushed = framed, waiting, {}
    block.sum.clear()  # the pushes of the round it replaces are not summed
    block.round, block.adopting, block.restored, block.round_encoding = round_ + 1, False, True, None
    log.info("block %d: round %d restored from node %s (%d node(s) were waiting for it)", block_id, round_,
             node_id, len(waiting))
    if waiting:
        sink.deliver(block_id, round_, framed, waiting)
    return PushOutcome(accepted=True)
