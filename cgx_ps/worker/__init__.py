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

Subpackages: ``frontends`` (where gradients enter), ``pipeline`` (a step's per-block work), ``shards``
(the connections), ``intranode``, ``tuning`` (adaptive bits, auto mode), ``broadcast``.
docs/architecture.md follows one gradient through these modules.
"""

from .tuning.tuner import Decision
from .broadcast.api import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .checkpoint import Checkpoints
from .config import WorkerConfig
from .frontends.ddp_hook import DDPHookState, ddp_comm_hook
from .frontends.ddp_catch_up import catch_up_with
from .errors import (BlobFormatError, BroadcastError, CgxPsError, CheckpointError, CollectiveStalledError, ConfigError,
                     IntraNodeError, RoundFailedError, ShardRejectedError, ShardUnavailableError, StepAbandoned)
from .pipeline.blocks import Compression
from .frontends.join import join
from .frontends.optimizer import DistributedOptimizer, StepStats
from .runtime import init, rank, shutdown, size

__all__ = [
    "BlobFormatError", "BroadcastError", "CgxPsError", "CheckpointError", "Checkpoints", "CollectiveStalledError",
    "Compression", "ConfigError",
    "DDPHookState", "Decision", "DistributedOptimizer", "ddp_comm_hook",
    "IntraNodeError", "RoundFailedError", "ShardRejectedError", "ShardUnavailableError", "StepAbandoned", "StepStats",
    "WorkerConfig",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "catch_up_with", "init", "join", "rank",
    "shutdown", "size",
]
