"""Which way a step's gradients go, decided in one place for both front ends.

Every step goes through the shards (compressed, or fp32 during warm-up), except auto mode's
uncompressed steps when a ``torch.distributed`` process group is there and
``uncompressed_via="allreduce"``: those are averaged by all_reduce on the group, so that where
compression does not pay a step costs what DDP's costs. The decision is a pure function of the
step's state (``choose_route``) that returns an explicit outcome (``Route``); a ``StepRouter``
carries it out for one front end::

    router = StepRouter(pipe, via, auto, group_of, block_order)  # StepDriver.open_together builds it
    route = router.choose()            # at a step's first gradient, after auto mode's decision
    router.collective(route)           # the optimizer's executor: BlockAllreduce on route.group
    router.probe(nbytes)               # auto mode's measure of the all_reduce path (a collective)

The front ends differ only in who all-reduces: the optimizer gives its parameters' order
(``block_order``) and the router averages its blocks over the group (``uncompressed.BlockAllreduce``);
the DDP hook gives none and all-reduces its buckets itself with DDP's allreduce on ``route.group``
(the DDP model's group). Every rank applies auto mode's decisions at the same step boundary, so
every rank takes the same route. The ``StepDriver`` chooses the route once per step and keeps it
until the step ends.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch.distributed as dist

from ..pipeline.block_pipeline import BlockPipeline
from .uncompressed import BlockAllreduce, allreduce_rate

__all__ = ["Route", "SHARDS", "StepRouter", "choose_route", "collective_group"]


class Route(NamedTuple):
    """Where one step's gradients are averaged: ``path`` "shards" (the block pipeline, compressed
    or not) or "allreduce" (all_reduce on ``group``)."""

    path: str
    group: "dist.ProcessGroup | None" = None

    @property
    def size(self) -> int:
        """The group's size (an "allreduce" route): what each gradient is divided by."""
        return dist.get_world_size(self.group)


SHARDS = Route("shards")


def choose_route(compress: bool, via: str, group: "dist.ProcessGroup | None") -> Route:
    """This step's route: all_reduce on ``group`` for an uncompressed step (auto mode's
    decision, ``compress``) with ``via="allreduce"`` and a group to use; else the shards."""
    if not compress and via == "allreduce" and group is not None:
        return Route("allreduce", group)
    return SHARDS


def collective_group(process_group: "dist.ProcessGroup | None", via: str) -> "dist.ProcessGroup | None":
    """The group auto mode's uncompressed steps all_reduce on: the one given, else the default
    group once ``torch.distributed`` is initialized; None (the shards) for ``via="shards"``."""
    if via != "allreduce":
        return None
    if process_group is not None:
        return process_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class StepRouter:
    """One front end's routes (module doc): its group, the probe of the all_reduce path, and the
    optimizer's executor of that path."""

    def __init__(self, pipe: BlockPipeline, via: str, auto: bool,
                 group_of: Callable[[], "dist.ProcessGroup | None"], block_order: Sequence[str] | None) -> None:
        """``via``: ``uncompressed_via``; ``auto``: auto mode (the only one with uncompressed steps
        after warm-up). ``group_of()``: the front end's process group (None: the default group); read at each
        use, as the DDP model's may be gone. ``block_order``: the parameters' registration order
        when the router all-reduces the blocks itself (the optimizer); None when the front end
        all-reduces its own tensors (the DDP hook)."""
        self.pipe, self.via, self.auto = pipe, via, auto
        self._group_of, self._block_order = group_of, block_order
        self._allreduce: BlockAllreduce | None = None  # opened at its first use

    def group(self) -> "dist.ProcessGroup | None":
        """The group uncompressed steps would all_reduce on, or None (they use the shards)."""
        return collective_group(self._group_of(), self.via)

    def may_allreduce(self) -> bool:
        """Whether any step may take the all_reduce path: auto mode, with a group to use."""
        return self.auto and self.group() is not None

    def choose(self) -> Route:
        """This step's route, from auto mode's decision as the pipeline holds it now."""
        compress = self.pipe.compress
        return choose_route(compress, self.via, None if compress else self.group())

    def collective(self, route: Route) -> BlockAllreduce | None:
        """The executor of an "allreduce" route where the router averages the blocks itself:
        the collective on the route's group, opened (the group checked, a collective) at its
        first use; None otherwise (the shards, or the front end all-reduces)."""
        if route.path != "allreduce" or self._block_order is None:
            return None
        if self._allreduce is None or self._allreduce.group is not route.group:
            self._allreduce = BlockAllreduce.open(self.pipe, route.group, self._block_order)
        return self._allreduce

    def probe(self, nbytes: int) -> float | None:
        """For auto mode's model: the all_reduce rate on the group of the uncompressed steps, or
        None (they use the shards). The tuner calls it on every rank at the same step (a
        collective), at a step's first gradient, before any of that step's blocks or buckets is
        started, so it never interleaves with them. Where the router all-reduces the blocks, the
        collective is opened first: the group is checked before it is timed."""
        group = self.group()
        if group is None:
            return None
        if self._block_order is not None:
            group = self.collective(Route("allreduce", group)).group
        return allreduce_rate(group, nbytes)
