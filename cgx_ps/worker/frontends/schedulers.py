"""Per-step learning-rate schedulers across the rounds a late node catches up on.

Under quorum rounds a node that was late applies the rounds it missed without computing them
(``pipeline/catch_up.py``), one optimizer step per round, inside one of its own steps. A scheduler
the loop steps once per batch would then be stepped once for all of them: the node would apply
those rounds at the learning rate of the step it computed, and go on r steps behind the others'
schedule, and its replica would part from theirs without an error. Given to
``cgx.catch_up_with(..., schedulers=[...])``, each is stepped before each caught-up round, as the
other nodes' loops stepped it after each of theirs; the loop's own ``scheduler.step()`` after
``opt.step()`` then brings it to the round under way, as on every other node. A rate changed any
other way (a scheduler stepped per epoch, ``ReduceLROnPlateau``, a write to ``param_groups``) is
not replayed: a node that caught up across the change applied some rounds at the old rate.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from ..errors import ConfigError

__all__ = ["checked_schedulers", "scheduler_problem", "step_schedulers"]


def scheduler_problem(scheduler: object, optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``scheduler`` cannot be stepped for ``optimizer``'s caught-up rounds, or None."""
    if not isinstance(scheduler, LRScheduler):
        return f"schedulers takes torch LR schedulers (torch.optim.lr_scheduler), got {type(scheduler).__name__}"
    if isinstance(scheduler, ReduceLROnPlateau):
        return ("ReduceLROnPlateau steps on a metric (once per epoch), which a caught-up round has none of: "
                "leave it out and step it per epoch as before")
    # the same param_groups, not the same object: a scheduler built on the torch optimizer before
    # DistributedOptimizer wrapped it sets the rates the wrapped one steps with
    if scheduler.optimizer.param_groups is not optimizer.param_groups:
        return f"the {type(scheduler).__name__} given steps another optimizer than the one given with it"
    return None


def checked_schedulers(schedulers: Iterable[object], optimizer: torch.optim.Optimizer) -> list[LRScheduler]:
    """``schedulers`` as a list, each checked (``scheduler_problem``); ConfigError names the first problem."""
    found = list(schedulers)
    for scheduler in found:
        problem = scheduler_problem(scheduler, optimizer)
        if problem is not None:
            raise ConfigError(f"cgx.catch_up_with: {problem}")
    return found


def step_schedulers(schedulers: Sequence[LRScheduler]) -> None:
    """Before a caught-up round's optimizer step: what the other nodes' loops did after theirs."""
    for scheduler in schedulers:
        scheduler.step()
