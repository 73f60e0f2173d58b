"""cgx_ps.server — where gradients are summed: one parameter-server shard per process.

    service.py     gRPC entry point: Register, Exchange streams, chunk reassembly, backpressure
    aggregator.py  per-block rounds: dequantize-accumulate, re-quantize once, timeouts
    main.py        the process: uvloop, health, metrics, graceful drain
    status.py      the Status RPC (`cgx-ps status`) and the session gauges
    cluster.py     several local shard processes (development, demo, tests)
"""

from .aggregator import Aggregator, PushRejected, RoundFailure
from .cluster import LocalCluster
from .config import CHUNK_BYTES, GRPC_OPTIONS, ServerConfig
from .main import ShardServer, run_server

__all__ = ["Aggregator", "CHUNK_BYTES", "GRPC_OPTIONS", "LocalCluster", "PushRejected", "RoundFailure",
           "ServerConfig", "ShardServer", "run_server"]
