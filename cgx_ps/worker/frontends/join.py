"""Uneven inputs (torch's ``Join``, for cgx-ps): a node that runs out of data leaves the rounds,
and the others go on without waiting for it (docs/stragglers.md, "Uneven inputs").

    for epoch in range(epochs):
        with cgx.join(opt):                      # a DistributedOptimizer
            for x, y in loader:                  # a different number of batches on each node
                loss_fn(model(x), y).backward()
                opt.step()

Under the DDP hook, the same with the hook's state and the plain optimizer (ddp_join.py):

        with cgx.join(opt, hook_state=state):    # ddp.register_comm_hook(state, cgx.ddp_comm_hook)

When the ``with`` block ends, the node takes *shadow steps* until every node has left: each
round's blocks go to the shards out of data (counted, summing nothing: every result divides by
the gradients it sums), and the node applies the round's averages with an optimizer step of its
own, as the nodes that computed them do (leaving.py, pipeline/shadow.py). Every replica,
optimizer state included, stays bit-identical, every node leaves the ``with`` at the same round,
and the next epoch starts with every node again.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..errors import CgxPsError
from .ddp_hook import DDPHookState
from .ddp_join import hook_leaver
from .leaving import Leaver, leave_when_done
from .optimizer_steps import DistributedMixin

__all__ = ["join"]


@contextlib.contextmanager
def join(optimizer: torch.optim.Optimizer, hook_state: DDPHookState | None = None) -> Iterator[None]:
    """Leave the rounds when the block ends (the node ran out of data), then take shadow steps
    until every node has left (module doc).

    Args:
        optimizer: a ``DistributedOptimizer``; under the DDP hook, the torch optimizer that
            steps the DDP model's parameters (holding no other trainable tensor).
        hook_state: under the DDP hook, the ``DDPHookState`` registered on the DDP model itself
            (not on the model it wraps), built without ``find_unused_parameters`` and, if the
            model has buffers, with ``broadcast_buffers=False`` (ddp_join.py says why).

    Raises:
        CgxPsError: at entry, for an optimizer or state other than these, one already inside
            ``join``, several local ranks per node, adaptive or auto compression; at exit, for a
            backward whose ``step()`` did not come, a shard's failure, or a round whose average
            was not finite. An exception from the block is raised as
            it is, without leaving (the other nodes' rounds then wait for this node until their
            timeout, as for a node that crashed).
    """
    leaver = hook_leaver(optimizer, hook_state) if hook_state is not None else _optimizer_leaver(optimizer)
    with leave_when_done(leaver):
        yield


def _optimizer_leaver(optimizer: torch.optim.Optimizer) -> Leaver:
    if not isinstance(optimizer, DistributedMixin):
        raise CgxPsError(f"cgx.join takes a DistributedOptimizer, got {type(optimizer).__name__} (under the DDP "
                         f"hook: cgx.join(optimizer, hook_state=state))")

    def unfinished() -> str | None:
        if not optimizer._cgx_passes:
            return None
        return ("the block ended between a backward and its step(): call step() (or zero_grad(), which "
                "abandons the step on every node) before leaving")

    # the wrapped optimizer's own step: the averages are in .grad already
    return Leaver(optimizer, "this optimizer", optimizer._cgx_driver, optimizer._cgx_grad_out,
                  lambda: super(DistributedMixin, optimizer).step(), unfinished)
