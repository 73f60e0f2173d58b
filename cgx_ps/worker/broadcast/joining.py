"""Which nodes a worker waits for while a broadcast waits: said while it waits and when it gives up.

A broadcast's readers wait for the root rank's blob; before the first one every node must have
started, so a node started alone (restarted after the others finished, or the others failed to
start) waits there. The shard knows how many nodes registered (Status.nodes_registered); every
``REPORT_EVERY_S`` while some have not, the waiting worker says so, and a broadcast that times out
with nodes missing is blamed on them, not on the root's blob.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from ...v1 import ps_pb2, ps_pb2_grpc
from ..shards.client import ShardClient
from ..config import node_name

__all__ = ["REPORT_EVERY_S", "absent_nodes", "nodes_joined", "report_absent_nodes"]

log = logging.getLogger(__name__)
REPORT_EVERY_S = 15.0
_STATUS_TIMEOUT_S = 5.0


def absent_nodes(num_nodes: int, registered: int, own_node_rank: int) -> str:
    """Words naming the nodes that have not registered ("" when none is missing). The shard counts
    registered nodes; when we are the only one, the absent ones are every other node by name."""
    if registered >= num_nodes:
        return ""
    if registered <= 1:
        return ", ".join(node_name(rank) for rank in range(num_nodes) if rank != own_node_rank)
    return f"{num_nodes - registered} of the other {num_nodes - 1} nodes"


async def nodes_joined(shard: ShardClient) -> tuple[int, int] | None:
    """(nodes registered, nodes expected) in the shard's session, or None if it cannot say now."""
    try:
        status = await ps_pb2_grpc.ParameterServerStub(shard.channel).Status(
            ps_pb2.StatusRequest(), timeout=_STATUS_TIMEOUT_S, metadata=shard.metadata)
    except grpc.aio.AioRpcError:
        return None
    return status.nodes_registered, status.num_nodes


async def report_absent_nodes(shard: ShardClient, waiting_for: str, own_node_rank: int) -> None:
    """Log, now and every REPORT_EVERY_S until cancelled, which nodes have not joined, if any."""
    while True:
        joined = await nodes_joined(shard)
        if joined is not None and (absent := absent_nodes(joined[1], joined[0], own_node_rank)):
            log.warning("waiting for %s: %d of %d nodes have joined shard %s; not yet: %s", waiting_for,
                        joined[0], joined[1], shard.address, absent)
        await asyncio.sleep(REPORT_EVERY_S)
