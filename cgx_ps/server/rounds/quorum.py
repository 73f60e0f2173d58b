"""Quorum rounds: a block's round that closes without its slowest nodes, and what late nodes get.

A job may set a quorum (``CGX_PS_QUORUM=K`` nodes of N, ``CGX_PS_GRACE_MS=G``; ps.proto
RegisterRequest.quorum). A block's round then closes when every node has pushed it, as always,
or when K nodes have and G more milliseconds have passed (the aggregator's grace timer). Each
block closes on its own, as each block's round always has: a block's average is unbiased over the
gradients it sums, and closing a step's blocks together would need the shards to agree on each
step, a round trip between them the data path does not have. Every node still gets the same
bytes for each (block, round), so replicas stay bit-identical.

A node whose push comes after its round closed (*late*) is told so at once (ps.proto LateNotice)
and gets that round's result, kept for late nodes a bounded number of rounds back
(``RoundHistory``). Its gradient is not dropped: it is *carried* into the round under way, as
the change it makes to the average of the round it was computed for (late_rounds.py), so every
gradient counts exactly once, with the weight it would have had in time, at most
``keep_rounds`` rounds late. A result's header says how many gradients in time it averages
(``kernels.wire.set_contributors``), and every node divides by that. A node that fell several
rounds behind fetches the results it missed (PushChunk.fetch) and applies them without
recomputing them (the worker's catch-up).

The decisions are small functions of their inputs: ``cgx_ps.quorum_settings.quorum_problem``
(the settings), ``QuorumRule.after_push`` (whether a round waits, starts its grace or closes)
and ``RoundHistory.late_outcome`` (what a late push or a fetch is).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Literal, Mapping

from ..errors import BadRequest, WrongRound
from ..rpc.push_frames import ResultFrames

__all__ = ["ClosedRound", "LateOutcome", "LateWatch", "QuorumRule", "RoundAction", "RoundHistory"]

RoundAction = Literal["wait", "grace", "close"]  # QuorumRule.after_push

@dataclass(frozen=True)
class QuorumRule:
    """A session's quorum: ``quorum`` of ``nodes`` close a round ``grace_s`` after the last of
    them; ``keep_rounds``: how many closed rounds each block keeps for late nodes."""

    nodes: int
    quorum: int = 0  # 0: every node
    grace_s: float = 0.0
    keep_rounds: int = 16

    @property
    def active(self) -> bool:
        return 0 < self.quorum < self.nodes

    def after_push(self, pushed: Collection[str], last_rounds: Mapping[str, int], round_: int,
                   nodes_seen: int, skipping: Collection[str] = ()) -> RoundAction:
        """What a round of a block does after a push that did not complete it (or a fetch of it):
        ``pushed``: the nodes that pushed it so far; ``last_rounds``: the latest round each node
        pushed of the block (in time or late); ``nodes_seen``: nodes that pushed in this session so
        far; ``skipping``: nodes that fetch this round instead of pushing it (a late node catching
        up: worker/pipeline/catch_up.py), which it never waits for.

        - "wait": for more pushes. Always before every node has pushed once (at the job's start
          the first node up would run ahead of the others, which start seconds apart), and
          before ``quorum`` nodes have pushed.
        - "close": now. The nodes still missing are *behind*: they have not pushed even the
          previous round, late or not (a stalled node, or one catching up), so waiting for them
          would only cost the grace. A stall then costs one grace, in the round it began. A
          node late once (say by jitter) pushes that round late before the others push this one,
          so it still gets the grace here; a node late by a whole step or more is late again until
          it catches up, as a node that slow would be in any case.
        - "grace": close after the grace unless the rest come; said once, at the quorum's push.
        """
        if not self.active or nodes_seen < self.nodes or len(pushed) < self.quorum:
            return "wait"
        behind = sum(1 for node, last in last_rounds.items()
                     if node not in pushed and (last < round_ - 1 or node in skipping))
        if len(pushed) + behind >= self.nodes:
            return "close"
        return "grace" if len(pushed) == self.quorum else "wait"


@dataclass
class ClosedRound:
    """A block's closed round, as late nodes need it: its result, who pushed in time, who late."""

    round: int
    result: ResultFrames
    pushers: dict[str, int]  # node -> member, in time
    # the gradients its average would have had if every node still in the rounds had pushed in
    # time: a late gradient's share of it (rounds/late_rounds.py)
    expected: int
    late: dict[str, int] = field(default_factory=dict)  # node -> member, after the round closed


@dataclass(frozen=True)
class LateOutcome:
    """What a push or fetch of a closed round gets: ``result`` (the round's), and whether the push
    is a late node's first (``carry``: its gradient goes into the round under way) or a retry."""

    closed: ClosedRound
    carry: bool

    @property
    def result(self) -> ResultFrames:
        return self.closed.result


class RoundHistory:
    """A block's last ``keep`` closed rounds (the memory bound: that many results per block)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._rounds: deque[ClosedRound] = deque(maxlen=keep)

    def add(self, closed: ClosedRound) -> None:
        self._rounds.append(closed)

    def get(self, round_: int) -> ClosedRound | None:
        if self._rounds and self._rounds[0].round <= round_ <= self._rounds[-1].round:
            at = round_ - self._rounds[0].round
            # contiguous unless a resume moved the block's round, or a round had no result (every
            # node had left it: rounds/uneven.py)
            if at < len(self._rounds) and self._rounds[at].round == round_:
                return self._rounds[at]
        return next((c for c in self._rounds if c.round == round_), None)

    def late_outcome(self, block_id: int, block_round: int, node: str, member: int, round_: int,
                     fetch: bool = False) -> LateOutcome:
        """A push (or, with ``fetch``, a fetch) of ``round_`` by ``node``'s ``member``, the block
        being at ``block_round`` > ``round_``. Raises WrongRound for a round no longer kept, and
        BadRequest for another member of a node that pushed the round."""
        closed = self.get(round_)
        if closed is None:
            raise WrongRound(f"block {block_id}: node {node} asks for round {round_}, {block_round - round_} "
                             f"round(s) behind the block's round {block_round}; a shard keeps the last {self.keep} "
                             f"rounds' results for late nodes (the node fell too far behind)")
        by = closed.pushers.get(node, closed.late.get(node))
        if by is not None and by != member:
            raise BadRequest(f"block {block_id} round {round_} was already pushed by member {by} of node {node}: one "
                             f"local rank pushes each block")
        return LateOutcome(closed, carry=not fetch and by is None)


class LateWatch:
    """A session's late pushes per node, and when to say so: ``note`` returns a log line the first
    time a node's pushes are late in at least ``share`` of its last ``window`` pushes, and again
    after each further ``window`` pushes while that lasts (one line per window, not per push)."""

    def __init__(self, window: int = 100, share: float = 0.25) -> None:
        self.window, self.share = window, share
        self.total: dict[str, int] = {}  # late pushes per node, over the session
        self._recent: dict[str, deque[bool]] = {}
        self._quiet_until: dict[str, int] = {}  # the node's push count before which nothing is said
        self._pushes: dict[str, int] = {}

    def note(self, node: str, late: bool) -> str | None:
        recent = self._recent.setdefault(node, deque(maxlen=self.window))
        recent.append(late)
        count = self._pushes[node] = self._pushes.get(node, 0) + 1
        if late:
            self.total[node] = self.total.get(node, 0) + 1
        if len(recent) < self.window or count < self._quiet_until.get(node, 0):
            return None
        late_share = sum(recent) / len(recent)
        if late_share < self.share:
            return None
        self._quiet_until[node] = count + self.window
        return (f"node {node} was late in {late_share:.0%} of its last {len(recent)} pushes (quorum rounds closed "
                f"without it; its gradients were carried into later rounds): a slow or stalled node")
