"""Uneven inputs: a node that has run out of data leaves a block's rounds (ps.proto
PushChunk.out_of_data; docs/stragglers.md, "Uneven inputs").

Such a push counts the node as pushed and sums nothing from it, so no round waits for a node
that has left; the round's result says how many gradients it sums (``contributors``) and every
node divides by that, the node that left included: it applies the same bytes with an optimizer
step of its own and stays bit-identical. A round that sums no gradient at all (every node has
left, nothing carried) has no result: every node is told (EveryoneLeft) and the round id is used
up alike everywhere. Until then, a node that left may not push a gradient of the block: it would
come back in the middle of the others' epoch. The caller (the aggregator) holds the block's lock.
"""

from __future__ import annotations

from ...kernels import Codec
from ...model_layout import codec_of
from ..errors import BadRequest
from .block_state import BlockState

__all__ = ["close_without_gradients", "gradients_in", "refuse_after_leaving", "round_encoding"]


def refuse_after_leaving(block: BlockState, node_id: str, round_: int) -> None:
    """Raises BadRequest for a gradient from a node that left the block's rounds."""
    left = block.left.get(node_id)
    if left is not None:
        raise BadRequest(f"block {block.spec.block_id} round {round_}: node {node_id} left the rounds at round {left} "
                         f"(out of data) and cannot push a gradient until every node has left (a new epoch)")


def gradients_in(block: BlockState, pushed: int) -> int:
    """The gradients a round of ``pushed`` pushes sums: those not out of data, and carried ones."""
    return pushed - len(block.absent) + len(block.carried)


def close_without_gradients(block: BlockState) -> dict[str, int]:
    """Every node pushed the round out of data: end it without a result, forget who left (the
    next round is a new epoch's), and return the nodes (node -> member) to tell."""
    for timer in (block.timer, block.grace):
        if timer is not None:
            timer.cancel()
    told = {**block.fetchers.pop(block.round, {}), **block.pushed}
    block.last_pushed, block.last_result = block.pushed, None
    block.pushed, block.absent, block.left, block.carried, block.grace = {}, set(), {}, [], None
    block.round_encoding, block.round_non_finite = None, False
    block.round += 1
    return told


def round_encoding(block: BlockState, round_: int) -> tuple[int, int, int]:
    """How the round's result is encoded: as its pushes were; a round that sums only gradients
    carried from late pushes (every node in time left it) the block's settings for the round."""
    if block.round_encoding is not None:
        return block.round_encoding
    settings = block.settings_for(round_)
    codec = codec_of(settings)
    return (int(codec), settings.bits, settings.bucket_size) if codec == Codec.MAXMIN else (int(Codec.FP32), 32, 0)
