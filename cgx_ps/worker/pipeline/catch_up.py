"""Quorum rounds, a node that fell behind: the rounds it missed, applied without recomputing them.

Under ``CGX_PS_QUORUM`` a round closes without its slowest nodes (server/rounds/quorum.py). A node
whose push came after its round closed is told how far the block has moved on (a LateNotice), and
its gradient is carried into a later round by the shard. After such a step, ``missed_rounds``
fetches the results of every round the node missed, one round at a time (every block's result of
that round, the same bytes every other node applied), decodes each round into the block buffers
as a finished step would, and yields it: the front end writes it into the gradients and steps its
optimizer, without a forward or backward. Once through, the node pushes the block's current
round next and trails no more; its step count, warm-up included, is the other nodes'.
"""

from __future__ import annotations

from typing import Callable, Iterator

from ..config import WorkerConfig
from ..errors import CgxPsError
from ..shards.engine import CommEngine, EngineShare
from .block_exchange import BlockExchange, BlockState, abandoned_result

__all__ = ["missed_rounds"]


def missed_rounds(blocks: list[BlockState], engine: CommEngine | EngineShare, exchange: BlockExchange,
                  config: WorkerConfig, count_step: Callable[[], None]) -> Iterator[int]:
    """Each round this node missed, its averages in the block buffers when yielded (the front end
    then applies them: ``copy_out`` and an optimizer step), then counted (``count_step``).
    Nothing without a quorum, or when the last step was in time everywhere. Raises CgxPsError if
    a missed round's average is not finite (a step the others' loss scalers skipped)."""
    if not config.has_quorum or not blocks:
        return
    start = blocks[0].round
    ahead = engine.rounds_ahead(start, [b.spec.block_id for b in blocks])
    for round_ in range(start, start + ahead):
        running = [engine.submit(_fetch_and_decode(engine, exchange, block, round_)) for block in blocks]
        timeout = 2 * engine.round_timeout_s + 10  # each round closes within the round timeout
        if any([done.result(timeout) for done in running]):
            raise CgxPsError(f"round {round_}, which this node missed (quorum rounds), came back not finite: its "
                             f"catch-up cannot apply a step other nodes' loss scalers skipped")
        for block in blocks:
            block.round = round_ + 1
        count_step()
        yield round_


async def _fetch_and_decode(engine: CommEngine | EngineShare, exchange: BlockExchange, block: BlockState,
                            round_: int) -> bool:
    """A missed round's result of one block, decoded into its buffer; whether it is not finite."""
    result = await engine.fetch(block.spec.shard, block.spec.block_id, round_)
    block.result = block.buffer
    await engine.in_thread(exchange.decode, block, result)
    return abandoned_result(block.buffer)
