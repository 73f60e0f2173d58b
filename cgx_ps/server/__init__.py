"""cgx_ps.server — where gradients are summed: one parameter-server shard per process.

    service.py     gRPC entry point: Register, Exchange streams, chunk reassembly, backpressure
    aggregator.py  per-block rounds: dequantize-accumulate, re-quantize once, timeouts
    main.py        the process: uvloop, health, metrics, graceful drain
    cluster.py     several local shard processes (development, demo, tests)
"""

from .aggregator import Aggregator, RoundFailure
from .cluster import LocalCluster
from .config import CHUNK_BYTES, GRPC_OPTIONS, ServerConfig
from .errors import ProtocolError
from .main import ShardServer, run_server

__all__ = ["Aggregator", "CHUNK_BYTES", "GRPC_OPTIONS", "LocalCluster", "ProtocolError", "RoundFailure",
           "ServerConfig", "ShardServer", "run_server"]
