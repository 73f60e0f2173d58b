"""One job's session on a shard: its members, their streams, and where each result goes.

A session starts with a job's first Register (admission.py decides when) and lasts until one of
its rounds fails, another job or a restarted member replaces it, or the shard stops. It owns

- membership: the nodes and their members (local ranks) that registered, and the session id
  handed to them as proof (a stranger cannot act on the session);
- the newest Exchange stream of each member (a reconnect replaces the old one);
- the Aggregator summing its rounds, for which it is the sink: it hears each result with the
  members that pushed it, and each failure.

Who pushed what is recorded in one place, the aggregator's block (node -> member, for the round
under way and the one before), where it decides acceptance, duplicates and resends under the
block's lock. ``streams`` only says where each member listens now: a result goes to the stream
a pusher has when the result is ready, so a member that reconnected mid-round gets it on its
new stream and there is nothing to rewrite or undo.
"""

from __future__ import annotations

import logging
import secrets
import time
from concurrent.futures import Executor
from typing import Mapping

from ...kernels.wire import HEADER_SIZE
from ...v1 import ps_pb2
from ..rounds.aggregator import Aggregator, RoundFailure
from .blobs import BlobStore
from ..config import ServerConfig
from ..errors import ProtocolError, StreamAborted
from ..metrics import ShardMetrics
from ..rpc.push_frames import ResultFrames
from .outbound import NodeStream
from ..rounds.kernel_threads import per_call_threads, usable_cpus
from ..rounds.quorum import LateWatch, QuorumRule

__all__ = ["Session", "owned_blocks"]

log = logging.getLogger(__name__)


def owned_blocks(layout: ps_pb2.Layout, shard_index: int) -> list[ps_pb2.BlockSpec]:
    """The blocks of a layout that the shard ``shard_index`` sums."""
    return [b for b in layout.blocks if b.shard == shard_index]


class Session:
    def __init__(self, request: ps_pb2.RegisterRequest, digest: str, config: ServerConfig, executor: Executor | None,
                 blobs: BlobStore, metrics: ShardMetrics | None = None, incarnation: int | None = None) -> None:
        owned = owned_blocks(request.layout, config.shard_index)
        # what the job declared at its first Register
        self.layout = ps_pb2.Layout()
        self.layout.CopyFrom(request.layout)
        self.layout_hash = digest
        self.num_nodes = request.num_nodes
        self.job_id = request.job_id
        # which start of the job (admission.session_incarnation; the request's when not given)
        self.incarnation = request.incarnation if incarnation is None else incarnation
        self.resumed = request.resume  # started by a recovering node after this shard restarted
        # membership, and its proof
        self.nodes: dict[str, set[int]] = {}  # node id -> members registered
        self.session_id = secrets.token_hex(16)
        # streams: each member's newest; the members that ever opened one (they began training)
        self.streams: dict[tuple[str, int], NodeStream] = {}
        self.active: set[tuple[str, int]] = set()
        self.last_activity = time.monotonic()
        # result bytes one stream may have waiting: a client reads a block's result before pushing
        # the block's next round, so two rounds of every block (a resend on top) is already generous
        self.result_cap = 2 * sum(HEADER_SIZE + 4 * b.numel for b in owned) + (1 << 20)
        self.ended: str | None = None  # why the session ended (the first reason given)
        self.quorum_settings = (request.quorum, request.grace_ms)  # every node must send the same
        self.late = LateWatch()  # quorum rounds: pushes that came after their round closed, per node
        self.gone: set[str] = set()  # nodes named as gone: their streams ended, rounds closed without them
        self.aggregator = Aggregator(owned, request.num_nodes, executor, sink=self, registered=self.nodes.keys(),
                                     round_timeout_s=config.round_timeout_s, error_feedback=config.error_feedback,
                                     metrics=metrics, resumed=request.resume,
                                     kernel_split=per_call_threads(config.kernel_threads, usable_cpus()),
                                     quorum=QuorumRule(request.num_nodes, request.quorum, request.grace_ms / 1000))
        self._blobs = blobs  # the shard's store: the session's blobs go when it ends
        self._metrics = metrics

    @property
    def failed(self) -> RoundFailure | None:
        return self.aggregator.failed

    # ---- membership -----------------------------------------------------------------------------

    def proves(self, session_id: str) -> bool:
        """Does ``session_id`` prove membership of this session? (constant time)"""
        return secrets.compare_digest(session_id.encode(), self.session_id.encode())

    def is_member(self, node: str, member: int, session_id: str) -> bool:
        return member in self.nodes.get(node, ()) and self.proves(session_id)

    def started(self, node: str, member: int) -> bool:
        """Has this member of a node begun training (so a new Register means it restarted)?"""
        return (node, member) in self.active or node in self.aggregator.pushed_nodes()

    def started_any(self) -> bool:
        """Has any member begun training in this session?"""
        return bool(self.active) or bool(self.aggregator.pushed_nodes())

    def join(self, node: str, member: int) -> None:
        self.nodes.setdefault(node, set()).add(member)
        self.last_activity = time.monotonic()

    # ---- streams --------------------------------------------------------------------------------

    def open_stream(self, node: str, member: int) -> NodeStream:
        """The member's new stream; an older one ends (results still due come to the new one)."""
        stream = NodeStream(node, member, self.result_cap)
        old = self.streams.get((node, member))
        if old is not None:
            old.stop(StreamAborted(f"replaced by a newer stream of node {node} member {member} (a reconnect)"))
        self.streams[(node, member)] = stream
        self.active.add((node, member))
        if node in self.gone:
            self.gone.discard(node)
            log.warning("node %s is back (a new stream after it was named gone)", node)
        self.last_activity = time.monotonic()
        return stream

    def close_stream(self, stream: NodeStream) -> None:
        if self.streams.get((stream.node_id, stream.member)) is stream:
            del self.streams[(stream.node_id, stream.member)]
        self.last_activity = time.monotonic()

    # ---- the aggregator's sink ------------------------------------------------------------------

    def deliver(self, block_id: int, round_: int, result: ResultFrames, pushers: Mapping[str, int]) -> None:
        """Send a round's result (its frames, the same for every node) to the stream of every
        member that pushed it (one per node)."""
        streams = [s for s in map(self.streams.get, pushers.items()) if s is not None]
        for stream in streams:
            stream.send(result.frames, len(result), block_id, round_)
        if self._metrics:
            self._metrics.bytes_out.inc(len(result) * len(streams))
        if len(pushers) < self.num_nodes:  # a quorum round closed without some nodes
            self._name_gone(pushers)

    def _name_gone(self, pushers: Mapping[str, int]) -> None:
        """Name, once, each node whose streams have all ended (a node killed, or its host lost)
        while rounds still close without it. Only then: every node's streams end at a job's end
        too, after the last round it needs has closed, and a node that is merely late still has
        its stream."""
        listening = {node for node, _ in self.streams}
        gone = [node for node, _ in self.active
                if node not in pushers and node not in listening and node not in self.gone]
        for node in sorted(set(gone)):
            self.gone.add(node)
            remain = len(self.nodes.keys() - self.gone)
            log.warning("node %s went away mid-run (its streams ended: killed, or its connection lost); quorum "
                        "rounds close without it: %d of %d nodes remain, CGX_PS_QUORUM=%d (fewer than that: "
                        "rounds fail at the round timeout)", node, remain, self.num_nodes,
                        self.aggregator.rule.quorum)

    def everyone_left(self, block_id: int, round_: int, pushers: Mapping[str, int]) -> None:
        """Every node pushed the round out of data (uneven inputs): tell each of them."""
        notice = ps_pb2.ExchangeResponse(everyone_left=ps_pb2.EveryoneLeft(round=round_, block_id=block_id))
        for stream in [s for s in map(self.streams.get, pushers.items()) if s is not None]:
            stream.send_control(notice)

    def round_failed(self, failure: RoundFailure) -> None:
        """A round failed for everyone: every stream hears why in-band, then the session ends."""
        error = ps_pb2.ExchangeResponse(error=ps_pb2.RoundError(
            round=failure.round, block_id=failure.block_id, message=failure.message,
            missing_nodes=list(failure.missing_nodes)))
        for stream in self.streams.values():
            stream.send_control(error)
        self.end(StreamAborted(failure.message))

    def end(self, error: ProtocolError) -> None:
        """Stop the rounds, drop the blobs and end every stream with ``error``. The first reason
        stands: "reset after failure" must not hide the failure itself, and a session replaced
        earlier cannot clear its successor's blobs."""
        if self.ended is None:
            self.ended = error.message
            self.aggregator.close()
            self._blobs.clear()
        for stream in self.streams.values():
            stream.stop(error)
