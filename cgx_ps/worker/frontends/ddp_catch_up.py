"""Quorum rounds under the DDP hook: ``cgx.catch_up_with(optimizer, hook_state=state)`` (and a
``DistributedOptimizer``'s per-step schedulers: ``cgx.catch_up_with(opt, schedulers=[...])``).

    ddp = DDP(model)
    state = cgx.DDPHookState(ddp, compression="4bit")
    ddp.register_comm_hook(state, cgx.ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    cgx.catch_up_with(opt, hook_state=state)     # once, before the first backward
    for x, y in loader:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()

Under ``CGX_PS_QUORUM`` a round closes without its slowest nodes, and a node that was late
applies the rounds it missed without computing them (``pipeline/catch_up.py``): each with an
optimizer step of its own. ``DistributedOptimizer`` takes those steps inside its ``step()``; the
hook runs inside DDP's backward and never sees the optimizer, so it is told which one steps the
DDP model here. After each of that optimizer's own steps (a step post-hook), the rounds this node
missed are written into the parameters' ``.grad`` and the optimizer steps once per round, as
``DistributedOptimizer`` does, so parameters and optimizer state stay bit-identical to the other
nodes'. The hook refuses a quorum at its first backward until this was called.

A step the user's loop skips (a GradScaler's overflow) runs no post-hook: its missed rounds are
applied after the next step that is taken.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler

from ... import timeline
from ..errors import CgxPsError, ConfigError
from ..pipeline.buffers import TensorOf
from .ddp_hook import DDPHookState
from .optimizer_steps import DistributedMixin
from .schedulers import checked_schedulers, step_schedulers

__all__ = ["catch_up_with", "foreign_tensors", "gradients_of"]


def gradients_of(params: dict[str, torch.Tensor]) -> TensorOf:
    """Where a round's averages go when no backward wrote them: each parameter's ``.grad``
    (zeros first where ``zero_grad()`` set it to None)."""
    def grad_out(name: str) -> torch.Tensor | None:
        param = params[name]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return param.grad

    return grad_out


def foreign_tensors(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor]) -> int:
    """How many trainable tensors ``optimizer`` steps that are not among ``params`` (the DDP
    model's): a step this node takes alone (a catch-up or shadow step) would apply their stale
    gradients on this node only."""
    known = {id(p) for p in params.values()}
    return sum(1 for g in optimizer.param_groups for p in g["params"] if p.requires_grad and id(p) not in known)


def catch_up_with(optimizer: torch.optim.Optimizer, hook_state: DDPHookState | None = None,
                  schedulers: Sequence[LRScheduler] = ()) -> None:
    """Under quorum rounds, let a late node step ``optimizer`` (and ``schedulers``) for the
    rounds it missed.

    Under the DDP hook, call it once per ``DDPHookState``, before the first backward; without a
    quorum it does nothing but run the step's after-work (metrics) a little earlier. A
    ``DistributedOptimizer`` catches up by itself: call it (without ``hook_state``) only to give
    it the learning-rate schedulers your loop steps once per batch (``schedulers.py``).

    Args:
        optimizer: the torch optimizer that steps the DDP model (its parameters alone), or a
            ``DistributedOptimizer``.
        hook_state: the ``DDPHookState`` registered with ``ddp_comm_hook`` (None with a
            ``DistributedOptimizer``).
        schedulers: the torch LR schedulers of ``optimizer`` that the loop steps after every
            ``optimizer.step()``: each is stepped before each round caught up on, so the node
            applies every round at the rate the other nodes did (not ``ReduceLROnPlateau``, nor
            schedulers stepped per epoch).

    Raises:
        CgxPsError: ``hook_state`` is not a ``DDPHookState``, or ``optimizer`` is not a torch
            optimizer; at its first step, ``optimizer`` holds
            tensors that are not the DDP model's (a catch-up step would apply their stale
            gradients on this node alone).
        ConfigError: called twice for the same optimizer or state; a scheduler that is not a
            per-step torch LR scheduler of ``optimizer``; a ``DistributedOptimizer`` with a
            ``hook_state``, or a torch optimizer without one.
    """
    if isinstance(optimizer, DistributedMixin):
        if hook_state is not None:
            raise ConfigError("cgx.catch_up_with: a DistributedOptimizer catches up by itself; hook_state is for "
                              "the torch optimizer of a DDP model under the hook")
        if optimizer._cgx_catch_up_schedulers is not None:
            raise ConfigError("cgx.catch_up_with was already called for this DistributedOptimizer")
        optimizer._cgx_catch_up_schedulers = checked_schedulers(schedulers, optimizer)
        return
    if hook_state is None:
        raise ConfigError("cgx.catch_up_with: a torch optimizer under the DDP hook needs hook_state (the "
                          "DDPHookState registered with ddp_comm_hook)")
    if not isinstance(hook_state, DDPHookState):
        raise CgxPsError(f"cgx.catch_up_with's hook_state takes the DDPHookState registered with ddp_comm_hook, "
                         f"got {type(hook_state).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CgxPsError(f"cgx.catch_up_with takes the torch optimizer that steps the DDP model, got "
                         f"{type(optimizer).__name__}")
    if hook_state._catch_up is not None:
        raise ConfigError("cgx.catch_up_with was already called for this DDPHookState")
    hook_state._catch_up = _CatchUp(hook_state, optimizer, checked_schedulers(schedulers, optimizer))


class _CatchUp:
    """The step post-hook: after the user's step, one more step per round this node missed."""

    def __init__(self, state: DDPHookState, optimizer: torch.optim.Optimizer,
                 schedulers: list[LRScheduler]) -> None:
        self._state = state
        self._optimizer = optimizer
        self._schedulers = schedulers
        # its own steps run the post-hook too, and so do cgx.join's shadow steps (rounds already)
        self.paused = False
        self._checked = False
        self._handle = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, *_: object) -> None:
        driver = self._state._driver
        if self.paused or driver is None:
            return
        params = self._state._params
        if not self._checked:
            foreign = foreign_tensors(self._optimizer, params)
            if foreign:
                raise CgxPsError(f"the optimizer given to cgx.catch_up_with holds {foreign} trainable "
                                 f"tensor(s) that are not the DDP model's: give it the DDP model's optimizer")
            self._checked = True
        driver.after_step()  # this step's after-work before the next rounds' fetches, as step() does
        pipe = driver.pipe
        grad_out = gradients_of(params)
        self.paused = True
        try:
            for round_ in driver.missed_rounds():
                for block in range(pipe.num_blocks):
                    pipe.copy_out(block, grad_out)
                with timeline.span("catch-up", round_):
                    step_schedulers(self._schedulers)  # each round at the rate the others used
                    self._optimizer.step()
        finally:
            self.paused = False
