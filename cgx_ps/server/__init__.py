"""cgx_ps.server — where gradients are summed: one parameter-server shard per process.

    service.py     the gRPC servicer: maps each call to the session, the blob store or the codecs
    rpc.py         the gate on every call: job token, draining, parsing, errors -> status codes
    dataplane.py   the raw data plane (--data-port): Exchange streams over plain TCP, through the gate
    errors.py      what a shard refuses, as plain exceptions (rpc.STATUS_CODES maps them)
    admission.py   who may join: the checks of a Register and the join/restart/refuse decision
    session.py     one job's session: members, their streams, where each result goes
    stream.py      a member's Exchange stream, outbound: queued results, bounded, and the writer
    reassembly.py  pushed chunks into whole blocks, within the memory budget and deadlines
    aggregator.py  per-block rounds: keep the pushes, sum and re-quantize once, timeouts, restores
    blockstate.py  one block's round state and the push checks, as small functions
    blobs.py       the broadcast store: blobs of the session, uploads checked chunk by chunk
    budget.py      an async byte budget (backpressure)
    config.py      the shard's settings: each one's default, environment variable and flag
    metrics.py     Prometheus metrics of one shard
    tls.py         server TLS whose certificate files may be rotated under a running shard
    main.py        the process: uvloop, health, metrics, graceful drain
    allocator.py   the process's malloc thresholds: a round's freed buffers kept for the next
    fdlimit.py     the process's open-file limit: raised to what the caps' connections need, or a refusal
    status.py      the Status RPC (`cgx-ps status`) and the session gauges
    cluster.py     several local shard processes (development, demo, tests)
"""

import importlib
from typing import Any

# Each public name and its module, imported on first use: the CLI reads the shard's settings
# (config.py) to build its flags without loading torch and gRPC for every `cgx-ps --help`.
_EXPORTS = {"Aggregator": "aggregator", "RoundFailure": "aggregator", "LocalCluster": "cluster",
            "CHUNK_BYTES": "config", "GRPC_OPTIONS": "config", "ServerConfig": "config",
            "ProtocolError": "errors", "ShardServer": "main", "run_server": "main"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
