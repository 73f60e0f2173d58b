"""cgx_ps.worker — where gradients enter: turn a single-process PyTorch script into compressed
data-parallel training against the cgx-ps shards.

    import cgx_ps.worker as cgx
    cgx.init()                                   # RANK, WORLD_SIZE, ..., CGX_PS_SERVERS
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression="4bit")
    cgx.broadcast_parameters(model.state_dict(), root_rank=0)
    cgx.broadcast_optimizer_state(opt, root_rank=0)
    ... loss.backward(); opt.step()

    config.py     the job from the environment         layout.py     blocks from sorted names
    optimizer.py  front end: hooks, .grad, step()       pipeline.py   a step's per-block work
    buffers.py    the blocks' flat buffers              engine.py     the communication thread
    client.py     one shard connection, kept alive     broadcast.py  root -> all via shard 0
    recovery.py   what to do when a shard connection breaks (reopen, rejoin, give up, hung)
    intranode.py  local ranks reduce first (segment.py, rendezvous.py, cuda_ipc.py, shm_flags.py)
    autotune.py   adaptive bits and auto mode decide    adaptive.py, knapsack.py, automode.py
    metrics.py    optional Prometheus exporter (CGX_PS_WORKER_METRICS_PORT), fed by step()
"""

from .autotune import Decision
from .blobformat import BlobFormatError
from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .config import WorkerConfig
from .errors import (BroadcastError, CgxPsError, ConfigError, IntraNodeError, RoundFailedError, ShardRejectedError,
                     ShardUnavailableError)
from .layout import Compression
from .optimizer import DistributedOptimizer, StepStats
from .runtime import init, rank, shutdown, size

__all__ = [
    "BlobFormatError", "BroadcastError", "CgxPsError", "Compression", "ConfigError", "Decision", "DistributedOptimizer",
    "IntraNodeError", "RoundFailedError", "ShardRejectedError", "ShardUnavailableError", "StepStats", "WorkerConfig",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "init", "rank",
    "shutdown", "size",
]
