"""Quorum rounds, a node that fell behind: the rounds it missed, applied without recomputing them.

Under ``CGX_PS_QUORUM`` a round closes without its slowest nodes (server/rounds/quorum.py). A node
whose push came after its round closed is told how far the block has moved on (a LateNotice), and
its gradient is carried into a later round by the shard. After such a step, ``missed_rounds``
fetches the results of every round the node missed and of the round under way (``catch_up_rounds``
says why that one too), one round at a time (every block's result of that round, the same bytes
every other node applied), decodes each round into the block buffers as a finished step would,
and yields it: the front end writes it into the gradients and steps its optimizer, without a
forward or backward. Once through, the node computes the next round from its start, as the others
do, and trails no more; its step count, warm-up included, is the other nodes'. The round under
way is waited for a bounded time (``StepPace``): it may never close, the other nodes having ended
the job; then the node computes it instead, late, and its gradient is carried as before.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time
from collections import deque
from typing import Callable, Iterator

from ..config import WorkerConfig
from ..errors import CgxPsError
from ..shards.engine import CommEngine, EngineShare
from .block_exchange import BlockExchange, BlockState, abandoned_result

__all__ = ["StepPace", "catch_up_rounds", "missed_rounds"]


def catch_up_rounds(next_round: int, late_at: int | None) -> int:
    """How many rounds from ``next_round`` a node applies without computing them, after a step in
    which a shard told it it was late with the block at round ``late_at`` (None: in time, none).

    Every round the block moved past, and the round under way too: a node that is late, even by a
    few milliseconds, starts its next compute that much after the others, who started at the
    round's close; it would be late again, round after round, each time costing the others the
    grace. Skipping the round under way (its result comes when it closes, and the shard does not
    wait for a node that fetches it) puts the node's next compute at the same start as theirs."""
    return 0 if late_at is None else late_at - next_round + 1


class StepPace:
    """The node's own pace: the median time between its last steps (1 s before it has any), and
    from it how long a catching-up node waits at most for the round under way: two steps and the
    grace, as it closes about one step after the previous round did."""

    def __init__(self, window: int = 9) -> None:
        self._last: float | None = None
        self._intervals: deque[float] = deque(maxlen=window)

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now

    def under_way_wait_s(self, grace_s: float) -> float:
        step_s = statistics.median(self._intervals) if self._intervals else 1.0
        return 2 * step_s + grace_s


def missed_rounds(blocks: list[BlockState], engine: CommEngine | EngineShare, exchange: BlockExchange,
                  config: WorkerConfig, count_step: Callable[[], None], pace: StepPace) -> Iterator[int]:
    """Each round this node missed and the round under way (``catch_up_rounds``), its averages in
    the block buffers when yielded (the front end then applies them: ``copy_out`` and an optimizer
    step), then counted (``count_step``). Nothing without a quorum, or when the last step was in
    time everywhere. Raises CgxPsError if a missed round's average is not finite (a step the others'
    loss scalers skipped)."""
    if not config.has_quorum or not blocks:
        return
    pace.tick()
    start = blocks[0].round
    late_at = engine.late_notice([b.spec.block_id for b in blocks])
    timeout = 2 * engine.round_timeout_s + 10  # each round closes within the round timeout
    for round_ in range(start, start + catch_up_rounds(start, late_at)):
        fetching = [engine.submit(engine.fetch(b.spec.shard, b.spec.block_id, round_)) for b in blocks]
        if round_ == late_at:
            done, _ = concurrent.futures.wait(fetching, pace.under_way_wait_s(config.grace_ms / 1000))
            if len(done) < len(fetching):
                # not closed yet: compute it instead (a fetch left waiting shares its result with
                # that push's: exchange_stream.expect)
                return
        results = [f.result(timeout) for f in fetching]
        decoding = [engine.submit(_decode(engine, exchange, b, r)) for b, r in zip(blocks, results)]
        if any([d.result(timeout) for d in decoding]):
            raise CgxPsError(f"round {round_}, which this node missed (quorum rounds), came back not finite: its "
                             f"catch-up cannot apply a step other nodes' loss scalers skipped")
        for block in blocks:
            block.round = round_ + 1
        count_step()
        yield round_


async def _decode(engine: CommEngine | EngineShare, exchange: BlockExchange, block: BlockState, result: bytes) -> bool:
    """A missed round's result of one block, decoded into its buffer; whether it is not finite."""
    block.result = block.buffer
    await engine.in_thread(exchange.decode, block, result)
    return abandoned_result(block.buffer)
