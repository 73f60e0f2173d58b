"""cgx_ps.server — where gradients are summed: one parameter-server shard per process.

Subpackages: ``rpc`` (the wire), ``session`` (who is in the job), ``rounds`` (summing), ``process``
(the process's resources). docs/architecture.md follows one gradient through these modules.
"""

import importlib
from typing import Any

# Each public name and its module, imported on first use: the CLI reads the shard's settings
# (config.py) to build its flags without loading torch and gRPC for every `cgx-ps --help`.
_EXPORTS = {"Aggregator": "rounds.aggregator", "RoundFailure": "rounds.aggregator", "LocalCluster": "cluster",
            "CHUNK_BYTES": "config", "GRPC_OPTIONS": "config", "ServerConfig": "config",
            "ProtocolError": "errors", "ShardServer": "main", "run_server": "main"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
