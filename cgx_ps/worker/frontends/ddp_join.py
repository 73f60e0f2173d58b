"""Uneven inputs under the DDP hook: ``cgx.join(optimizer, hook_state=state)`` (join.py).

    ddp = DDP(model, broadcast_buffers=False)
    state = cgx.DDPHookState(ddp, compression="4bit")
    ddp.register_comm_hook(state, cgx.ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(epochs):
        with cgx.join(opt, hook_state=state):
            for x, y in loader:                  # a different number of batches on each node
                opt.zero_grad()
                loss_fn(ddp(x), y).backward()
                opt.step()

A node out of data has no forward or backward, so DDP never calls the hook for it: its shadow
steps (leaving.py) go around DDP, straight to the state's block pipeline, write each round's
averages into the parameters' ``.grad`` and step the optimizer given, which the hook itself never
sees, so the parameters and the optimizer's state stay bit-identical to the other nodes'.

DDP's own collectives, outside the hook, must pair up on every rank too (gloo and NCCL pair them
by their order), and a node out of data runs none of its forwards:

- DDP rebuilds its buckets once, at the first forward with gradients after the first backward,
  broadcasting rank 0's bucket order. A node that ran out of data before that forward takes part
  at its first shadow round instead, as torch's own DDP join hook does (a no-op once rebuilt).
- With ``broadcast_buffers=True`` (the default) and a model with buffers, DDP broadcasts rank 0's
  buffers before each forward, evaluation forwards included: how many depends on the loop, not
  on rounds, so a shadow step cannot match them. Refused: build DDP with
  ``broadcast_buffers=False``.
- With ``find_unused_parameters=True`` each backward all-reduces which parameters each rank used,
  a collective a node out of data cannot tell it owes (the round that ends the epoch has none):
  refused.
"""

from __future__ import annotations

import torch

from ..errors import CgxPsError
from ..pipeline.block_pipeline import BlockPipeline
from .ddp_catch_up import foreign_tensors, gradients_of
from .ddp_hook import DDPHookState
from .handover import is_ddp
from .leaving import Leaver
from .optimizer_steps import DistributedMixin

__all__ = ["hook_leaver"]


def hook_leaver(optimizer: torch.optim.Optimizer, state: DDPHookState) -> Leaver:
    """The DDP hook's side of ``cgx.join``: shadow steps into the state's parameters' ``.grad``,
    stepped by ``optimizer``. Registers the state with the shards if no backward has yet.

    Raises:
        CgxPsError: ``state`` is not a ``DDPHookState`` on the DDP model itself, the DDP model
            broadcasts buffers or finds unused parameters, or ``optimizer`` is not a torch
            optimizer of the state's parameters alone; registering failed (``open()``).
        ConfigError: as ``DDPHookState.open()`` (a quorum, no ``init()``).
    """
    if not isinstance(state, DDPHookState):
        raise CgxPsError(f"cgx.join's hook_state takes the DDPHookState registered with ddp_comm_hook, got "
                         f"{type(state).__name__}")
    if isinstance(optimizer, DistributedMixin) or not isinstance(optimizer, torch.optim.Optimizer):
        raise CgxPsError(f"under the DDP hook cgx.join takes the torch optimizer that steps the DDP model, got "
                         f"{type(optimizer).__name__} (a DistributedOptimizer averages gradients itself: "
                         f"cgx.join(opt) without hook_state)")
    ddp = state.module
    if not is_ddp(ddp):
        raise CgxPsError(f"cgx.join needs the DDPHookState built on the DDP model itself, not on the "
                         f"{type(ddp).__name__} it wraps: a node out of data takes part in DDP's own collectives")
    if ddp.broadcast_buffers and len(ddp.modules_buffers) > 0:
        raise CgxPsError("cgx.join under the DDP hook needs DDP(..., broadcast_buffers=False) for a model with "
                         "buffers: DDP broadcasts them before every forward, which a node out of data has not")
    if ddp.find_unused_parameters:
        raise CgxPsError("cgx.join under the DDP hook does not support find_unused_parameters=True: each backward "
                         "all-reduces which parameters each rank used, which a node out of data has not")
    driver = state.open()
    params = state._params
    foreign = foreign_tensors(optimizer, params)
    if foreign:
        raise CgxPsError(f"the optimizer given to cgx.join holds {foreign} trainable tensor(s) that are not "
                         f"the DDP model's: give it the optimizer of the DDP model's parameters alone")

    catch_up = state._catch_up  # quorum rounds (ddp_catch_up.py): shadow steps are rounds already, none missed

    def before_round() -> None:
        if catch_up is not None:
            catch_up.paused = True  # until the join ends: its block's own steps catch up as ever
        # the bucket rebuild of the others' forward (module doc); DDP notes it as its forward does
        if ddp.reducer._rebuild_buckets():
            ddp._has_rebuilt_buckets = True

    watch = _StepWatch(optimizer, driver.pipe)

    def close() -> None:
        watch.close()
        if catch_up is not None:
            catch_up.paused = False

    return Leaver(state, "this DDPHookState", driver, gradients_of(params), optimizer.step, watch.unfinished,
                  before_round, close)


class _StepWatch:
    """Whether the optimizer stepped after the hook's last step: a block that ends between a
    backward and its step would leave this node one step behind the others for good."""

    def __init__(self, optimizer: torch.optim.Optimizer, pipe: BlockPipeline) -> None:
        self._pipe = pipe
        self._stepped_at = pipe.steps  # the hook's steps when the optimizer last stepped
        self._handle = optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, *_: object) -> None:
        self._stepped_at = self._pipe.steps

    def unfinished(self) -> str | None:
        # a loss scaler skips the optimizer step of a non-finite average, on every node alike
        if self._pipe.steps == self._stepped_at or self._pipe.stats.non_finite_average:
            return None
        return "the block ended between a backward and its optimizer step: call opt.step() before leaving"

    def close(self) -> None:
        self._handle.remove()
