"""How a round ends, as the aggregator tells it: a sum (or why it cannot be encoded), a failure
naming the nodes that did not push, and who hears of both (the session)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

from ..rpc.push_frames import ResultFrames

__all__ = ["RoundFailure", "RoundSink", "RoundSum"]


@dataclass(frozen=True, slots=True)
class RoundSum:
    """A round's sum as the kernel thread left it: the encoded result, framed for every node, or
    why it cannot be encoded."""

    result: ResultFrames | None
    error: str = ""


@dataclass(frozen=True)
class RoundFailure:
    block_id: int
    round: int
    message: str
    missing_nodes: tuple[str, ...]


class RoundSink(Protocol):
    """Who hears of finished and failed rounds (the session)."""

    def deliver(self, block_id: int, round_: int, result: ResultFrames, pushers: Mapping[str, int]) -> None:
        """``result`` of a round (framed once: the same frames go to every node), for each node's
        member in ``pushers`` (node id -> member)."""

    def round_failed(self, failure: RoundFailure) -> None: ...
