"""Uneven inputs (torch's ``Join``, for cgx-ps): a node that runs out of data leaves the rounds,
and the others go on without waiting for it (docs/stragglers.md, "Uneven inputs").

    for epoch in range(epochs):
        with cgx.join(opt):
            for x, y in loader:          # a different number of batches on each node
                loss_fn(model(x), y).backward()
                opt.step()

When the ``with`` block ends, the node takes *shadow steps* until every node has left: each
round's blocks go to the shards out of data (counted, summing nothing: every result divides by
the gradients it sums), and the node applies the round's averages with an optimizer step of its
own, as the nodes that computed them do (pipeline/shadow.py). Every replica, optimizer state
included, stays bit-identical, every node leaves the ``with`` at the same round, and the next
epoch starts with every node again.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ... import timeline
from ..errors import CgxPsError
from .optimizer_steps import DistributedMixin

__all__ = ["join"]


@contextlib.contextmanager
def join(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Leave the rounds when the block ends (the node ran out of data), then take shadow steps
    until every node has left (module doc).

    Args:
        optimizer: a ``DistributedOptimizer`` (the DDP hook does not support it: see
            docs/stragglers.md).

    Raises:
        CgxPsError: at entry, for another optimizer, one already inside ``join``, several local
            ranks per node, adaptive or auto compression; at exit, for a backward whose
            ``step()`` did not come, a shard's failure, or a round whose average was not finite.
            An exception from the block is raised as it is, without leaving (the other nodes'
            rounds then wait for this node until their timeout, as for a node that crashed).
    """
    if not isinstance(optimizer, DistributedMixin):
        raise CgxPsError(f"cgx.join takes a DistributedOptimizer, got {type(optimizer).__name__} (the DDP hook does "
                         f"not support uneven inputs: docs/stragglers.md)")
    pipe, options = optimizer._cgx_pipe, optimizer._cgx_driver.options
    if getattr(optimizer, "_cgx_joined", False):
        raise CgxPsError("this optimizer is already inside cgx.join: a node leaves the rounds once per epoch")
    if pipe.config.local_world_size != 1:
        raise CgxPsError(f"cgx.join needs one process per node (LOCAL_WORLD_SIZE={pipe.config.local_world_size})")
    if options.compression.adaptive or options.compression.auto:
        raise CgxPsError("cgx.join needs a fixed compression: adaptive bits and auto mode read the gradients, "
                         "which a node out of data does not have")
    optimizer._cgx_joined = True
    try:
        yield
        if optimizer._cgx_passes:
            raise CgxPsError("cgx.join: the block ended between a backward and its step(): call step() (or "
                             "zero_grad(), which abandons the step on every node) before leaving")
        for round_ in pipe.shadow_rounds():
            for block in range(pipe.num_blocks):
                pipe.copy_out(block, optimizer._cgx_grad_out)
            with timeline.span("shadow-step", round_):
                super(DistributedMixin, optimizer).step()  # the wrapped optimizer's own step
    finally:
        optimizer._cgx_joined = False
