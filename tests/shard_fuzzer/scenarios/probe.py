"""Probe streams: valid, empty, stalled, idle or cancelled, oversized."""

from __future__ import annotations

from cgx_ps.v1 import ps_pb2

from ..settings import MAX_MESSAGE, STALL_DEADLINE_S
from ..values import log_uniform
from ..world import Plan
from .registry import scenario

def probe_chunks(sizes: list[int]) -> list[bytes]:
    return [ps_pb2.ProbeChunk(data=bytes(n)).SerializeToString() for n in sizes]


@scenario("Probe")
def probe_valid(rng, w, who):
    return Plan(probe_chunks([log_uniform(rng, 2 << 20) for _ in range(rng.randint(1, 5))]))


@scenario("Probe")
def probe_empty(rng, w, who):
    return Plan([])


@scenario("Probe")
def probe_stall(rng, w, who):
    """One chunk, then silence past the round timeout: the shard must end the call itself."""
    return Plan(probe_chunks([rng.randrange(1, 1000)]), ending="stall", deadline=STALL_DEADLINE_S)


@scenario("Probe")
def probe_idle_or_cancelled(rng, w, who):
    return Plan(probe_chunks([100] * rng.randint(0, 3)), ending=rng.choice(("stall", "cancel")))


@scenario("Probe")
def probe_oversized(rng, w, who):
    return Plan(probe_chunks([MAX_MESSAGE + rng.randrange(1, 1 << 20)]))
