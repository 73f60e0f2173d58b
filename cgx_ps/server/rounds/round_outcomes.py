"""How a round ends, as the aggregator tells it: a sum (or why it cannot be encoded), a failure
naming the nodes that did not push, and who hears of both (the session)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from ... import timeline
from ...kernels import CodecError
from ..rpc.push_frames import ResultFrames

if TYPE_CHECKING:
    from .block_state import BlockState

__all__ = ["RoundFailure", "RoundSink", "RoundSum", "encode_round", "keep_push"]


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

    def everyone_left(self, block_id: int, round_: int, pushers: Mapping[str, int]) -> None:
        """Every node pushed the round out of data (uneven inputs): it has no result; tell them."""


def keep_push(block: "BlockState", round_: int, node_id: str, payload: bytes | memoryview,
              encode: Callable[[], memoryview] | None) -> RoundSum | None:
    """On a kernel thread: check and keep a push (CodecError: refused, nothing kept); with
    ``encode`` (the push completes its round), the round's sum too.

    Any other failure (memory exhausted, a bug) may leave the sum half changed: keeping the
    push that completes a round counts it before the encode fails, and the same push sent
    again would then be summed twice, a wrong result for every node without a word. So it
    fails the round, for every node, naming the error (a RoundSum without a result)."""
    try:
        with timeline.span("sum", round_, block=block.spec.block_id, node=node_id):
            block.sum.add(payload)
    except CodecError:
        raise
    except Exception as exc:  # noqa: BLE001 - see above: the round fails, named, for everyone
        return RoundSum(None, f"keeping node {node_id}'s push failed: {type(exc).__name__}: {exc}")
    return None if encode is None else encode_round(block, round_, encode)


def encode_round(block: "BlockState", round_: int, encode: Callable[[], memoryview]) -> RoundSum:
    """On a kernel thread: the round's sum, encoded and framed (or why it could not be)."""
    with timeline.span("re-encode", round_, block=block.spec.block_id):
        try:
            # framed straight from the encode buffer: the result's one copy (frames.ResultFrames)
            return RoundSum(ResultFrames.of(block.spec.block_id, round_, encode()))
        except CodecError as exc:  # one node sent huge finite values: the sum is not encodable
            return RoundSum(None, str(exc))
        except Exception as exc:  # noqa: BLE001 - see above
            return RoundSum(None, f"{type(exc).__name__}: {exc}")
