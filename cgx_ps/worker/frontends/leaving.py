"""What ``cgx.join`` (join.py) does with either front end: the checks at entry, and at exit the
node's leaving of the rounds and its shadow steps until every node has left (pipeline/shadow.py).

Each front end says what differs in a ``Leaver``: where a round's averages go (each parameter's
``.grad``), which optimizer steps them, what must be true before its block may end, and what it
shadows of its own collectives at each round (the DDP hook: DDP's bucket rebuild, ddp_join.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

from ... import timeline
from ..errors import CgxPsError
from ..pipeline.buffers import TensorOf
from .step_driver import StepDriver

__all__ = ["Leaver", "leave_when_done"]


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Leaver:
    """One front end's side of ``cgx.join``."""

    owner: object  # marked while inside cgx.join: one join at a time
    what: str  # how errors name it ("this optimizer")
    driver: StepDriver
    grad_out: TensorOf  # where a round's averages go: each parameter's .grad
    step: Callable[[], object]  # the wrapped optimizer's own step
    unfinished: Callable[[], str | None] = _nothing  # at exit: why the block may not end here, or None
    before_round: Callable[[], None] = _nothing  # before each shadow round: the front end's own collectives
    close: Callable[[], None] = _nothing  # when the join ends, however it ends


@contextlib.contextmanager
def leave_when_done(leaver: Leaver) -> Iterator[None]:
    """The block runs; when it ends the node leaves the rounds and takes shadow steps until
    every node has left. CgxPsError at entry or exit as ``cgx.join`` says."""
    try:
        _check_entry(leaver)
        leaver.owner._cgx_joined = True
        try:
            yield
            problem = leaver.unfinished()
            if problem is not None:
                raise CgxPsError(f"cgx.join: {problem}")
            leaver.driver.after_step()  # the last step's metrics, where no step() of ours ran them
            _shadow_steps(leaver)
        finally:
            leaver.owner._cgx_joined = False
    finally:
        leaver.close()


def _check_entry(leaver: Leaver) -> None:
    pipe, options = leaver.driver.pipe, leaver.driver.options
    if getattr(leaver.owner, "_cgx_joined", False):
        raise CgxPsError(f"{leaver.what} is already inside cgx.join: a node leaves the rounds once per epoch")
    if pipe.config.local_world_size != 1:
        raise CgxPsError(f"cgx.join needs one process per node (LOCAL_WORLD_SIZE={pipe.config.local_world_size})")
    if options.compression.adaptive or options.compression.auto:
        raise CgxPsError("cgx.join needs a fixed compression: adaptive bits and auto mode read the gradients, "
                         "which a node out of data does not have")


def _shadow_steps(leaver: Leaver) -> None:
    """Each round until every node has left: its averages into the gradients, an optimizer step."""
    pipe = leaver.driver.pipe
    rounds = pipe.shadow_rounds()
    while True:
        # what the nodes still training do in their forward of the round (every node, the round
        # that ends the epoch included: there every node is out of data)
        leaver.before_round()
        round_ = next(rounds, None)
        if round_ is None:
            return
        for block in range(pipe.num_blocks):
            pipe.copy_out(block, leaver.grad_out)
        with timeline.span("shadow-step", round_):
            leaver.step()
