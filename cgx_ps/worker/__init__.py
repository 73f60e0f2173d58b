"""cgx_ps.worker — where gradients enter: turn a single-process PyTorch script into compressed
data-parallel training against the cgx-ps shards.

    import cgx_ps.worker as cgx
    cgx.init()                                   # RANK, WORLD_SIZE, ..., CGX_PS_SERVERS
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression="4bit")
    cgx.broadcast_parameters(model.state_dict(), root_rank=0)
    cgx.broadcast_optimizer_state(opt, root_rank=0)
    ... loss.backward(); opt.step()

or, under DDP (and every trainer built on it: Lightning, Accelerate, the HF Trainer)::

    ddp = DDP(model)
    ddp.register_comm_hook(cgx.DDPHookState(ddp, compression="4bit"), cgx.ddp_comm_hook)

    config.py     the job from the environment         layout.py     blocks from sorted names
    optimizer.py  front end: hooks, .grad, step()       pipeline.py   a step's per-block work
    ddp_hook.py   front end: DDP buckets, futures       frontend.py   what both front ends share
    collective.py the optimizer's auto-mode uncompressed steps: all_reduce per block on a process group
    buffers.py    the blocks' flat buffers              engine.py     the communication thread
    client.py     one shard connection, kept alive     broadcast.py  root -> all via shard 0
    recovery.py   what to do when a shard connection breaks (reopen, rejoin, give up, hung)
    tlsprobe.py   why a shard closed the connection while connecting (a TLS mistake, or not)
    joining.py    which nodes have not joined, said while a broadcast waits and when it gives up
    dataplane.py  the Exchange stream over a shard's raw data plane (CGX_PS_DATAPLANE), and the choice
    intranode.py  local ranks reduce first (segment.py, rendezvous.py, cuda_ipc.py, shm_flags.py)
    autotune.py   adaptive bits and auto mode decide    adaptive.py, knapsack.py, automode.py
    metrics.py    optional Prometheus exporter (CGX_PS_WORKER_METRICS_PORT), fed by step()
    checkpoint.py a file per rank and step; resume from the newest complete one
    pipeline_state.py  the pipeline's part of a checkpoint   stepstats.py  what a step measured
"""

from .autotune import Decision
from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .checkpoint import Checkpoints
from .config import WorkerConfig
from .ddp_hook import DDPHookState, ddp_comm_hook
from .errors import (BlobFormatError, BroadcastError, CgxPsError, CheckpointError, CollectiveStalledError, ConfigError,
                     IntraNodeError, RoundFailedError, ShardRejectedError, ShardUnavailableError, StepAbandoned)
from .layout import Compression
from .optimizer import DistributedOptimizer, StepStats
from .runtime import init, rank, shutdown, size

__all__ = [
    "BlobFormatError", "BroadcastError", "CgxPsError", "CheckpointError", "Checkpoints", "CollectiveStalledError",
    "Compression", "ConfigError",
    "DDPHookState", "Decision", "DistributedOptimizer", "ddp_comm_hook",
    "IntraNodeError", "RoundFailedError", "ShardRejectedError", "ShardUnavailableError", "StepAbandoned", "StepStats",
    "WorkerConfig",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "init", "rank",
    "shutdown", "size",
]
