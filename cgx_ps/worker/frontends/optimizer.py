"""Where gradients enter cgx-ps: a drop-in DistributedOptimizer (in the spirit of Horovod).

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression="4bit")
    loss.backward(); opt.step()

A post-accumulate-grad hook on every parameter tells the block pipeline (``pipeline.py``) that
its gradient is final; once every parameter of a block is, the pipeline exchanges it (encode,
push, pull, decode) on the communication thread while backward goes on. ``step()`` waits only
for blocks still in flight and steps the wrapped optimizer. Every worker decodes the same
aggregate bytes, so replicas stay bit-identical.

A block that is a slice of one float32 ``.grad`` (every block of a large tensor) is encoded
straight from ``.grad`` and its average decoded straight back into it: no copy in or out,
whether ``zero_grad()`` keeps the gradients or sets them to None (torch's default). Blocks that
pack several small tensors, non-float32 gradients (upcast), and every block when the node's
local ranks reduce together or adaptive compression reads the block buffers, go through
the pipeline's flat float32 buffers instead (``buffers.work_in_place``). Between backward and
``step()`` the gradients belong to the pipeline: change them only after ``synchronize()``; a
step that raised may leave them partly averaged, so compute them again before retrying.

Auto mode (``compression="auto"``) with a ``torch.distributed`` process group: the steps it sends
uncompressed skip the shards and average each block with all_reduce on the group as backward
completes it (``frontends/uncompressed.py``), so where compression does not pay the optimizer costs what
DDP costs; every rank applies auto mode's decisions at the same step, so every rank takes the
same path (``route.py``, shared with the DDP hook).

For gradient clipping after synchronization (Horovod style)::

    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .step_driver import SyncOptions
from ..pipeline.blocks import DEFAULT_BLOCK_BYTES, Compression
from ..pipeline.block_pipeline import StepStats
from .optimizer_steps import DistributedMixin

__all__ = ["DistributedOptimizer", "StepStats"]


def DistributedOptimizer(  # noqa: N802 - a factory named like the class it returns (Horovod's API)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: str | Compression | None = "4bit",
    backward_passes_per_step: int = 1,
    error_feedback: bool = False,
    warmup_steps: int = 0,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    allow_non_finite: bool = True,
    uncompressed_via: str = "allreduce",
    process_group: "dist.ProcessGroup | None" = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` averages gradients across all workers through the
    shards, compressed.

    With mixed precision, synchronize before the scaler looks at the gradients (every rank's
    scaler then sees the same averaged gradients and skips the same steps)::

        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)              # optional: clip here
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()

    A backward that fails part way (an error in the loss's graph, an out-of-memory, a caught
    ``KeyboardInterrupt``): catch it, call ``zero_grad()`` and go on with the next batch.
    ``zero_grad()`` between a backward and its ``step()`` abandons that step on every rank: the
    blocks this rank had not pushed go as non-finite blocks (the marker of an abandoned step),
    the step's results are waited for (up to the round timeout) and dropped, and nothing is
    applied. Every other rank's ``step()`` raises ``StepAbandoned`` at once; catching it and
    calling ``zero_grad()`` skips the same step there, so the ranks stay in step and the
    replicas equal. With ``allow_non_finite`` the other ranks see a non-finite step, which their
    GradScaler skips, and it counts as a step on every rank, this one too.

    ``state_dict()`` adds a ``"cgx_ps"`` entry to the wrapped optimizer's state (counters, codec
    settings, auto/adaptive state, this rank's error-feedback residuals); ``load_state_dict()``
    before the first step resumes bit for bit (``cgx.Checkpoints``, docs/deploy.md).

    Args:
        optimizer: a built ``torch.optim.Optimizer`` holding every parameter to train.
        named_parameters: (name, tensor) pairs of those parameters, e.g.
            ``model.named_parameters()``: the names key the blocks, the same on every rank
            (default: ``param.0``, ``param.1``, ... in the optimizer's order).
        compression: "4bit" (default), "Nbit" for N in 1..8, "fp16", "bf16", "fp32", "adaptive"
            (bits per tensor re-chosen every 100 steps: fewer bytes at the error of uniform 4
            bits), "auto" (compress only when it measurably pays: a link-and-codec model makes the
            first choice, then measured step times of both modes decide), or a ``Compression``
            with name-pattern exclusions and per-tensor overrides. 1-D tensors and tensors under
            1024 elements always travel uncompressed.
        backward_passes_per_step: gradients accumulate over this many backward passes per step.
        error_feedback: carry each block's compression error into the next step (worker side).
        warmup_steps: the first steps travel uncompressed.
        block_bytes: fp32 bytes per block (1-4 MB balances pipelining against per-RPC cost).
        allow_non_finite: a NaN/Inf gradient on any rank reaches every rank as NaN (the
            default, as with DDP and Horovod), so a ``torch.amp.GradScaler`` skips the same step
            everywhere with no flag; such steps are counted (``cgx_ps_worker_non_finite_steps``,
            ``StepStats.non_finite_tensors``) and logged once a minute at most, naming the
            tensors, and ``step()`` without a scaler applies nothing and raises ``CgxPsError``.
            ``False``: that rank's ``step()`` raises ``CgxPsError`` naming the tensors and pushes
            the block as an abandoned step's marker: every other rank's ``step()`` raises
            ``StepAbandoned`` at once (a loop that catches both and calls ``zero_grad()`` skips
            the step on every rank).
        uncompressed_via: where the steps auto mode sends uncompressed go: "allreduce" (default:
            ``torch.distributed`` all_reduce on ``process_group``, or on the default group once
            ``torch.distributed`` is initialized, block by block as backward completes them, so a
            link fast enough that compression does not pay costs what DDP costs; without a group,
            the shards) or "shards" (fp32 through the shards). The group must hold every worker
            of the job (local ranks too: such a step skips the node's shared-memory reduction);
            its size is checked here, the rest (which ranks, one session) at the first such
            step. Other compression modes never use it.
        process_group: the group for those steps (default: the default group).

    Returns:
        The same optimizer as an instance of a subclass of its class (``DistributedSGD`` for an
        ``SGD``: LR schedulers and ``isinstance`` keep working), sharing its ``param_groups``
        and state, with ``synchronize()``, ``skip_synchronize()``, ``steps_done``, ``stats``, ``layout``,
        ``intranode`` and ``tuning_history`` added. It registers with the shards here.

    Raises:
        ConfigError: an option out of range, parameters named twice or missing from
            ``named_parameters``, a ``process_group`` smaller than the job, ``init()`` not
            called, or another ``DistributedOptimizer`` in this process.
        CgxPsError: registering with the shards failed (a ``ShardUnavailableError`` names the
            unreachable shard; a ``ShardRejectedError`` what the shard refused).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if named_parameters is None:
        named_parameters = [(f"param.{i}", p) for i, p in
                            enumerate(p for g in optimizer.param_groups for p in g["params"])]
    named_parameters = list(named_parameters)
    if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
               and isinstance(item[1], torch.Tensor) for item in named_parameters):
        raise ConfigError("named_parameters must give (name, tensor) pairs, e.g. model.named_parameters()")
    options = SyncOptions.of(compression, error_feedback, warmup_steps, block_bytes, allow_non_finite,
                             uncompressed_via)  # checks them all, uncompressed_via included
    if process_group is not None:
        if uncompressed_via != "allreduce":
            raise ConfigError("process_group is only used with uncompressed_via='allreduce'")
        if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
            raise ConfigError(f"process_group must be a torch.distributed ProcessGroup, got "
                              f"{type(process_group).__name__}")
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    cls = type(f"Distributed{type(optimizer).__name__}", (DistributedMixin, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # share param_groups, state and hooks
    wrapped._cgx_setup(named, options, backward_passes_per_step, uncompressed_via, process_group)
    return wrapped
