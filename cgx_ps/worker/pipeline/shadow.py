"""Uneven inputs, a node that has run out of data: its *shadow steps* until every node has left.

The node leaves each block's rounds with an out-of-data push (ps.proto PushChunk.out_of_data):
the shard counts it as pushed without a gradient, so no round waits for it, and sends it the
round's result, the same bytes the nodes still training apply. ``shadow_rounds`` decodes each
round's results into the block buffers and yields it: the front end writes them into the
gradients and steps its optimizer, without a forward or backward, so its parameters and
optimizer state stay bit-identical to the others'. A round in which no node pushed a gradient
(every node has left) comes back empty (EveryoneLeft): no step, the round id used up on every
node alike, and the shadow steps end. Under a quorum, an out-of-data push of a round that
closed already is answered with that round's result: the node catches up the same way.
"""

from __future__ import annotations

from typing import Callable, Iterator

from ..errors import CgxPsError
from ..shards.engine import CommEngine, EngineShare
from .block_exchange import BlockExchange, BlockState, abandoned_result

__all__ = ["shadow_rounds"]


def shadow_rounds(blocks: list[BlockState], engine: CommEngine | EngineShare, exchange: BlockExchange,
                  count_step: Callable[[], None]) -> Iterator[int]:
    """Each round until every node has left, its averages in the block buffers when yielded (the
    front end then applies them), then counted (``count_step``). Raises CgxPsError if a round's
    average is not finite (a step the other nodes' loss scalers skipped)."""
    timeout = 2 * engine.round_timeout_s + 10  # each round closes within the round timeout
    while blocks:
        round_ = blocks[0].round
        running = [engine.submit(_leave_and_decode(engine, exchange, block, round_)) for block in blocks]
        outcomes = [done.result(timeout) for done in running]
        for block in blocks:
            block.round = round_ + 1
        engine.late_notice([b.spec.block_id for b in blocks])  # late notices: caught up here
        if all(o is None for o in outcomes):
            return  # every node has left
        for block, outcome in zip(blocks, outcomes):
            if outcome is None:
                # Under a quorum, a late node's gradient carried into this round of some blocks
                # and not of others (lateness is per block): those blocks still sum it, these
                # were left by every node. Every node gets the same answers for every block, so
                # each applies zeros for these alike, and the next round ends them all.
                block.result = block.buffer
                block.buffer.zero_()
        if any(outcomes):
            raise CgxPsError(f"round {round_}, applied by this node after it ran out of data, came back not finite: "
                             f"its shadow step cannot apply a step other nodes' loss scalers skipped")
        count_step()
        yield round_


async def _leave_and_decode(engine: CommEngine | EngineShare, exchange: BlockExchange, block: BlockState,
                            round_: int) -> bool | None:
    """One block's round without a gradient: its result decoded into the block buffer (whether
    it is not finite), or None when every node has left."""
    result = await engine.fetch(block.spec.shard, block.spec.block_id, round_, out_of_data=True)
    if len(result) == 0:
        return None
    block.result = block.buffer
    await engine.in_thread(exchange.decode, block, result)
    return abandoned_result(block.buffer)
