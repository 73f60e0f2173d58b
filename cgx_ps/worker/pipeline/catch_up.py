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

A node of several local ranks takes each of these decisions once, for all its ranks: only a
block's owner (intranode/reduction.py) pushes it and hears that it was late, and the ranks must
catch up on the same rounds, or their step counts and replicas part. So after every step each
rank posts its notice in its segment and all take the furthest (``NodeReducer.vote``,
``node_late_at``); the round under way is applied only if every owner's fetches of it came back
in time (``node_closed``). The owners fetch their blocks' results of the missed rounds and share
them as a step's results are shared (decoded into the owner's buffer, copied by the others under
the same flags), rather than every rank fetching every block: one fetch per block and node, as
a step has one push, no decode on the ranks that do not own the block, and the flags that order
the node's next step count on from the rounds caught up on as from any step.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time
from collections import deque
from typing import Callable, Iterable, Iterator

from ..config import WorkerConfig
from ..errors import CgxPsError, StepAbandoned
from ..intranode.reduction import NodeReducer
from ..shards.engine import CommEngine, EngineShare
from .block_exchange import BlockExchange, BlockState, abandoned_result

__all__ = ["StepPace", "catch_up_rounds", "missed_rounds", "node_closed", "node_late_at"]


def catch_up_rounds(next_round: int, late_at: int | None) -> int:
    """How many rounds from ``next_round`` a node applies without computing them, after a step in
    which a shard told it it was late with the block at round ``late_at`` (None: in time, none).

    Every round the block moved past, and the round under way too: a node that is late, even by a
    few milliseconds, starts its next compute that much after the others, who started at the
    round's close; it would be late again, round after round, each time costing the others the
    grace. Skipping the round under way (its result comes when it closes, and the shard does not
    wait for a node that fetches it) puts the node's next compute at the same start as theirs."""
    return 0 if late_at is None else late_at - next_round + 1


def node_late_at(votes: Iterable[int]) -> int | None:
    """The node's ``late_at`` from its local ranks' votes (each the furthest round its own blocks
    were at when a shard said it was late, -1 for none): the furthest of them, None if every
    block was in time. The furthest, as one late block is enough: the node's next compute must
    start with the round under way of the block that moved on most."""
    late = max(votes, default=-1)
    return None if late < 0 else late


def node_closed(votes: Iterable[int]) -> bool:
    """Whether the round under way came back in time for the whole node: every local rank's
    vote is 1 (its fetches of it all done; a rank that owns none votes 1)."""
    return all(v == 1 for v in votes)


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
                  config: WorkerConfig, count_step: Callable[[], None], pace: StepPace,
                  reducer: NodeReducer | None = None) -> Iterator[int]:
    """Each round this node missed and the round under way (``catch_up_rounds``), its averages in
    the block buffers when yielded (the front end then applies them: ``copy_out`` and an optimizer
    step), then counted (``count_step``). Nothing without a quorum, or when the last step was in
    time everywhere. ``reducer``: the node's other local ranks, which decide with this one (every
    rank of the node calls this after every step). Raises CgxPsError if a missed round's average
    is not finite (a step the others' loss scalers skipped)."""
    if not config.has_quorum or not blocks:
        return
    pace.tick()
    start = blocks[0].round
    late_at = engine.late_notice([b.spec.block_id for b in blocks])
    if reducer is not None:
        late_at = node_late_at(reducer.vote(-1 if late_at is None else late_at, "the node's late notices"))
    owned, copied = [], []  # this rank's blocks, fetched; its node's other ranks', copied from them
    for b in blocks:
        (owned if reducer is None or reducer.owner(b.spec.block_id) == config.local_rank else copied).append(b)
    timeout = 2 * engine.round_timeout_s + 10  # each round closes within the round timeout
    for round_ in range(start, start + catch_up_rounds(start, late_at)):
        seq = round_ - blocks[0].base + 1  # the intra-node flags' count, as a step's (BlockPipeline.submit)
        fetching = [engine.submit(engine.fetch(b.spec.shard, b.spec.block_id, round_)) for b in owned]
        if round_ == late_at:
            done, _ = concurrent.futures.wait(fetching, pace.under_way_wait_s(config.grace_ms / 1000))
            closed = len(done) == len(fetching)
            if reducer is not None:
                closed = node_closed(reducer.vote(int(closed), "the node's round under way"))
            if not closed:
                # not closed yet: compute it instead (a fetch left waiting shares its result with
                # that push's: exchange_stream.expect)
                return
        try:
            _apply_owned(owned, fetching, engine, exchange, reducer, seq, timeout)
        except CgxPsError as error:  # the node's other ranks raise it too, instead of waiting
            raise error if reducer is None else reducer.first_error(error) from None
        copying = [engine.submit(_copy(exchange, b, seq)) for b in copied]
        if any([d.result(timeout) for d in copying]) or any(abandoned_result(b.buffer) for b in owned):
            raise CgxPsError(f"round {round_}, which this node missed (quorum rounds), came back not finite: its "
                             f"catch-up cannot apply a step other nodes' loss scalers skipped")
        for block in blocks:
            block.round = round_ + 1
        count_step()
        yield round_


def _apply_owned(owned: list[BlockState], fetching: list[concurrent.futures.Future],
                 engine: CommEngine | EngineShare, exchange: BlockExchange, reducer: NodeReducer | None,
                 seq: int, timeout: float) -> None:
    """The results of this node's own blocks (all of them, alone on the node) decoded into their
    buffers, and published to the other local ranks."""
    results = [f.result(timeout) for f in fetching]
    if reducer is not None:
        for block in owned:  # the others took the last result out of our buffer
            reducer.before_write(block.spec.block_id, seq)
    decoding = [engine.submit(_decode(engine, exchange, b, r)) for b, r in zip(owned, results)]
    for done in decoding:
        done.result(timeout)
    if reducer is not None:
        for block in owned:
            reducer.publish(block.spec.block_id, seq)


async def _decode(engine: CommEngine | EngineShare, exchange: BlockExchange, block: BlockState, result: bytes) -> None:
    """A missed round's result of one block, decoded into its buffer."""
    block.result = block.buffer
    await engine.in_thread(exchange.decode, block, result)


async def _copy(exchange: BlockExchange, block: BlockState, seq: int) -> bool:
    """A missed round's result of a block another local rank owns, copied from it as a step's is
    (``BlockExchange.fetch``); whether it is not finite."""
    block.result = block.buffer
    try:
        await exchange.fetch(block, seq)
    except StepAbandoned:  # not finite, without allow_non_finite: the caller says what that means here
        return True
    return abandoned_result(block.buffer)
