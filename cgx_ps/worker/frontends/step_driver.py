"""What both front ends share around the block pipeline: their options, the step's timing and
route, the work after a step (the tuner, metrics), and what they show of their steps.

``DistributedOptimizer`` (a hook per parameter, ``.grad``) and the DDP communication hook (a
future per DDP bucket) differ only in where gradients come from and go to. Each holds a
``StepDriver``:

    driver.gradient_arrived()                # each hook call: the step's timing; the last
                                             # step's after-work if nobody ran it yet
    driver.route()                           # the step's route (route.py), chosen once per step
    driver.submit_ready(names, grad_of[, out_of])  # these tensors are final: start their full
                                             # blocks (in place on grad_of's memory where it allows:
                                             # leave those tensors alone until the block is done;
                                             # out_of: where the averages go, if not there)
    driver.submit_rest(grad_of[, out_of])    # end of backward: the blocks still waiting (zeros)
    driver.finish(waiting_since)             # every block done: the step's stats
    driver.finish_elsewhere(waiting_since)   # or: the step was averaged without the shards
    driver.after_step()                      # the tuner (its broadcast blocks) and metrics
    for round_ in driver.missed_rounds():    # quorum rounds: each round this node missed, to
        ...                                  # apply (copy_out, an optimizer step); the tuner's
                                             # decisions of each follow, as after a step
    driver.abandon()                         # or: give the step up on every rank (a failed
                                             # backward; BlockPipeline.abandon_step)

On auto mode's uncompressed steps the route (``route.choose_route``) may send a step past the
shards, to an all_reduce on a process group: the DDP hook averages its buckets with DDP's
allreduce on ``route().group`` (then ``finish_elsewhere``); for the optimizer the driver sends
the blocks to ``uncompressed.BlockAllreduce`` in ``submit_ready``, ``submit_rest``, ``finish``
and ``abort``. Either way auto mode's model probes that path (``StepRouter.probe``), so it sees
both of its choices in both front ends.

``after_step`` runs once per finished step: from ``DistributedOptimizer.step()``, or, when no one
called it (DDP has no step; a GradScaler that skipped ``step()``), at the next step's first
gradient, on the training thread, never on the communication thread.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch.distributed as dist

from ...rate_limited_log import RateLimitedLog
from ...v1 import ps_pb2
from ..tuning.tuner import Decision, Tuner
from ..pipeline.buffers import TensorOf
from ..errors import CgxPsError, CheckpointError, ConfigError
from ..pipeline.blocks import DEFAULT_BLOCK_BYTES, Compression
from ..metrics import after_step as export_step_metrics
from ..pipeline.block_pipeline import BlockPipeline, PipelineSpec, StepStats
from .route import Route, StepRouter
from .uncompressed import BlockAllreduce

log = logging.getLogger(__name__)
# one line a minute at most: a diverged run has non-finite gradients every step, a GradScaler's
# overflows come in runs at the start; the metric counts every one of them
_NON_FINITE_LOG = RateLimitedLog(log, burst=1, window_s=60.0)

__all__ = ["FrontEndView", "StepDriver", "SyncOptions", "UNCOMPRESSED_VIA"]

# where auto mode's uncompressed steps go: a native allreduce on a process group (when there is
# one), or the shards' fp32 path
UNCOMPRESSED_VIA = ("allreduce", "shards")


@dataclass(frozen=True)
class SyncOptions:
    """The compression options both front ends take, checked once."""

    compression: Compression
    error_feedback: bool = False  # carry each block's compression error into the next step
    warmup_steps: int = 0  # the first steps travel uncompressed
    block_bytes: int = DEFAULT_BLOCK_BYTES  # fp32 bytes per block
    allow_non_finite: bool = True  # NaN/Inf gradients reach every rank as NaN instead of an error
    uncompressed_via: str = "shards"  # auto mode's uncompressed steps: "shards" or "allreduce" (a collective)

    @classmethod
    def of(cls, compression: "str | Compression | None", error_feedback: bool = False, warmup_steps: int = 0,
           block_bytes: int = DEFAULT_BLOCK_BYTES, allow_non_finite: bool = True,
           uncompressed_via: str = "shards") -> "SyncOptions":
        for name, value, least in [("warmup_steps", warmup_steps, 0), ("block_bytes", block_bytes, 4)]:
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
        for name, flag in [("error_feedback", error_feedback), ("allow_non_finite", allow_non_finite)]:
            if not isinstance(flag, bool):
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        if uncompressed_via not in UNCOMPRESSED_VIA:
            raise ConfigError(f"uncompressed_via must be one of {UNCOMPRESSED_VIA}, got {uncompressed_via!r}")
        return cls(Compression.parse(compression), error_feedback, int(warmup_steps), int(block_bytes),
                   allow_non_finite, uncompressed_via)

    def spec(self, named_tensors) -> PipelineSpec:
        return PipelineSpec(named_tensors, self.compression, self.block_bytes,
                            {"error_feedback": self.error_feedback, "warmup_steps": self.warmup_steps,
                             "allow_non_finite": self.allow_non_finite})


class StepDriver:
    """One front end's pipeline and the bookkeeping of its steps (see the module doc)."""

    def __init__(self, pipe: BlockPipeline, options: SyncOptions, router: StepRouter) -> None:
        """``router``: the front end's routes (``route.py``); auto mode's model probes the
        all_reduce path through it."""
        self.pipe, self.options, self.router = pipe, options, router
        compression = options.compression
        if pipe.config.has_quorum and compression.auto and options.uncompressed_via == "allreduce":
            # a collective waits for every rank by nature: a stalled node would hold every other
            # node at auto mode's uncompressed steps, which quorum rounds exist to avoid
            raise ConfigError(f"CGX_PS_QUORUM={pipe.config.quorum} with compression=\"auto\" needs "
                              f"uncompressed_via=\"shards\": with uncompressed_via=\"allreduce\" its uncompressed "
                              f"steps are a process group's all_reduce, which waits for every rank, a stalled one too")
        self.tuner = Tuner(pipe, compression, router.probe) if compression.adaptive or compression.auto else None
        # blocks whose gradients lie end to end in the front end's memory (a slice of one .grad,
        # a DDP bucket) are encoded from and decoded into it, not copied through the block
        # buffers, unless the node reduces through its buffers or adaptive bits' tuner reads them
        # (auto mode reads only step figures: its compressed steps work in place too)
        self.in_place = pipe.in_place(tuned=compression.adaptive)
        self._lock = threading.Lock()  # gradients may arrive on several autograd threads
        self._first: float | None = None  # this step's first gradient
        self._last = 0.0  # and its latest
        self._after_pending = False  # a step finished and its after-work has not run
        # this step's route, chosen at its first use and kept to its end, and its executor
        self._route: Route | None = None
        self._collective: BlockAllreduce | None = None

    @classmethod
    def open_together(cls, named_tensors_per_model: list, options: list[SyncOptions],
                      groups_of: Sequence[Callable[[], "dist.ProcessGroup | None"]], allreduce_blocks: bool
                      ) -> list["StepDriver"]:
        """One driver per model, registered with the shards as one session. ``groups_of``: each
        model's process group for auto mode's uncompressed steps (``StepRouter``); with
        ``allreduce_blocks`` the driver all-reduces those steps' blocks itself (the optimizer),
        else the front end all-reduces its own tensors on ``route().group`` (the DDP hook)."""
        pipes = BlockPipeline.open_together([o.spec(t) for t, o in zip(named_tensors_per_model, options)])
        return [cls(pipe, o, StepRouter(pipe, o.uncompressed_via, o.compression.auto, group_of,
                                        [n for n, _ in named] if allreduce_blocks else None))
                for pipe, o, group_of, named in zip(pipes, options, groups_of, named_tensors_per_model)]

    # ---- a step ------------------------------------------------------------------------------

    def gradient_arrived(self) -> bool:
        """Note a gradient's arrival; True when it is the step's first (the last step's
        after-work ran first, if it was still due)."""
        with self._lock:
            first = self._first is None
        if first:
            self.after_step()
        with self._lock:
            self._last = time.perf_counter()
            if self._first is None:
                self._first = self._last
        return first

    @property
    def last_gradient_at(self) -> float:
        return self._last

    def route(self) -> Route:
        """This step's route (``route.choose_route``): chosen at its first use in the step, after
        auto mode's decision was applied (at the same step on every rank), kept to the step's
        end. An "allreduce" route whose blocks the driver all-reduces opens its collective now."""
        return self._step_route()[0]

    def _step_route(self) -> tuple[Route, BlockAllreduce | None]:
        with self._lock:
            if self._route is None:
                route = self.router.choose()
                self._collective = self.router.collective(route)
                self._route = route
            return self._route, self._collective

    def _forget_route(self) -> BlockAllreduce | None:
        with self._lock:
            collective, self._route, self._collective = self._collective, None, None
            self._first = None
        return collective

    def submit_ready(self, names, grad_of: TensorOf, out_of: TensorOf | None = None) -> list[int]:
        """Start the blocks these tensors complete; returns them."""
        collective = self._step_route()[1]
        blocks = self.pipe.tensors_ready(names)
        self._start(blocks, grad_of, out_of, collective)
        return blocks

    def submit_rest(self, grad_of: TensorOf, out_of: TensorOf | None = None) -> None:
        collective = self._step_route()[1]
        self._start(self.pipe.take_unsubmitted(), grad_of, out_of, collective)

    def _start(self, blocks: list[int], grad_of: TensorOf, out_of: TensorOf | None,
               collective: BlockAllreduce | None) -> None:
        if collective is not None:  # this step is averaged on a process group, not the shards
            collective.ready(blocks, grad_of)
            return
        for block in blocks:
            self.pipe.submit(block, grad_of, self.in_place.allowed, out_of)

    def finish(self, waiting_since: float | None = None) -> StepStats:
        """Wait for every block (raises the first error, the step aborted), end the step."""
        collective = self._step_route()[1]
        if collective is None:
            return self._end_step(lambda backward_s: self.pipe.finish_step(backward_s, waiting_since))
        since = time.perf_counter() if waiting_since is None else waiting_since
        collective.wait(self.options.allow_non_finite)
        return self.finish_elsewhere(since)

    def finish_elsewhere(self, waiting_since: float) -> StepStats:
        """End a step the front end averaged without the shards (``pipe.step_done_elsewhere``)."""
        return self._end_step(lambda backward_s: self.pipe.step_done_elsewhere(backward_s, waiting_since))

    def _end_step(self, end) -> StepStats:
        with self._lock:
            backward_s = self._last - self._first if self._first is not None else 0.0
        self._forget_route()
        stats = end(backward_s)
        with self._lock:
            self._after_pending = True
        return stats

    def why_not_abandon(self) -> str | None:
        """Why the step under way cannot be abandoned, or None (nothing changes then)."""
        with self._lock:
            route = self._route
        if route is not None and route.path == "allreduce":
            # gloo pairs all_reduces by their order: this rank's next ones would pair with this step's
            return (f"rank {self.pipe.rank}: a step that auto mode sends over the process group's all_reduce cannot "
                    f"be abandoned (the other ranks' all_reduce waits for this rank's): stop every rank and restart "
                    f"from a checkpoint")
        return self.pipe.why_not_abandon()

    def abandon(self) -> None:
        """This rank gives up the step under way: every rank's step fails with StepAbandoned,
        this one's quietly (``BlockPipeline.abandon_step``); the next gradient starts a new one.
        Where the other ranks count the step (``allow_non_finite``), the tuner sees it here too.
        Raises CgxPsError, changing nothing, where ``why_not_abandon`` says why."""
        problem = self.why_not_abandon()
        if problem is not None:
            raise CgxPsError(problem)
        try:
            counted = self.pipe.abandon_step() is not None
        finally:
            self._forget_route()
        if counted:
            with self._lock:
                self._after_pending = True

    def abort(self) -> None:
        """Forget this step (after an error): the next gradient starts a new one. What the
        step's collective has in flight is waited for first (``BlockAllreduce.abort``)."""
        collective = self._forget_route()
        try:
            if collective is not None:
                collective.abort()
        finally:
            self.pipe.abort_step()

    def after_step(self) -> None:
        """The tuner (a collective over the shards: every rank runs it after the same step) and
        the step's metrics; once per finished step."""
        with self._lock:
            due, self._after_pending = self._after_pending, False
        if not due:
            return
        if self.tuner is not None:
            self.tuner.after_step()
        report_non_finite(self.pipe.stats, self.pipe.rank)
        export_step_metrics(self.pipe.stats, self.tuner.history if self.tuner is not None else ())

    def missed_rounds(self) -> Iterator[int]:
        """Quorum rounds: each round this node missed (``BlockPipeline.missed_rounds``: its
        averages in the block buffers), for the front end to apply (``copy_out`` and an optimizer
        step) before asking for the next one; after each, the tuner's decisions due at that
        round's step (``Tuner.after_caught_up_round``), as a computed step's ``after_step``."""
        for round_ in self.pipe.missed_rounds():
            yield round_
            if self.tuner is not None:
                self.tuner.after_caught_up_round(self.pipe.steps - 1)

    # ---- checkpoints (both front ends put this under their "cgx_ps" entry) --------------------

    def state_dict(self) -> dict:
        """Counters, codec settings, residuals (``BlockPipeline.state_dict``) and the tuner's state."""
        return {"pipeline": self.pipe.state_dict(),
                "tuner": self.tuner.state_dict() if self.tuner is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """What ``state_dict`` gave, before the first step; CheckpointError if it does not fit."""
        if not isinstance(state, dict) or "pipeline" not in state:
            raise CheckpointError("the checkpoint's \"cgx_ps\" entry is not a cgx-ps front end's state")
        self.pipe.load_state_dict(state["pipeline"])
        if self.tuner is not None and state.get("tuner") is not None:
            self.tuner.load_state_dict(state["tuner"])



class FrontEndView:
    """What both front ends show of their steps, read from their driver's pipeline and tuner.
    On a ``DDPHookState`` that has not registered yet (no backward, no ``open()``), each but
    ``steps_done`` raises ``CgxPsError``."""

    def _cgx_registered(self) -> StepDriver | None:
        """The front end's driver once it has registered with the shards, else None."""
        raise NotImplementedError

    def _cgx_step_driver(self) -> StepDriver:
        driver = self._cgx_registered()
        if driver is None:
            raise CgxPsError("the DDPHookState registers with the shards at the first backward (or open())")
        return driver

    @property
    def steps_done(self) -> int:
        """The job's steps this rank has finished: those it computed and, under a quorum
        (``CGX_PS_QUORUM``), the rounds it applied without computing them after it was late
        (counted on from a loaded checkpoint's steps; 0 before a ``DDPHookState`` registers).
        Drive a training loop under a quorum by it rather than by the batches: a node that
        caught up skips the batches of those rounds, and ends at the same step as the others
        (a loop over every batch would push rounds no other node takes part in)."""
        driver = self._cgx_registered()
        return driver.pipe.steps if driver is not None else 0

    @property
    def stats(self) -> StepStats:
        """The last finished step: bytes pushed, exposed communication, backward and transfer
        windows, non-finite tensors, the path it took (``StepStats``)."""
        return self._cgx_step_driver().pipe.stats

    @property
    def layout(self) -> ps_pb2.Layout:
        """The blocks and tensors registered with the shards (the same on every rank)."""
        return self._cgx_step_driver().pipe.layout

    @property
    def intranode(self) -> str | None:
        """How this node's local ranks reduce: "shm", "cuda", or None (alone on the node)."""
        return self._cgx_step_driver().pipe.intranode

    @property
    def tuning_history(self) -> list[Decision]:
        """The decisions of adaptive bits and auto mode so far, oldest first (empty otherwise);
        ``Decision.as_dict()`` gives each as plain data."""
        tuner = self._cgx_step_driver().tuner
        return list(tuner.history) if tuner is not None else []


def report_non_finite(stats: StepStats, rank: int) -> None:
    """Say, rate-limited, that a step's gradients were not finite on this rank, naming the tensors:
    under allow_non_finite such a step is skipped quietly by a GradScaler, and without one a NaN
    would otherwise go unseen until the loss shows it."""
    if not stats.non_finite_tensors:
        return
    names = ", ".join(stats.non_finite_tensors[:8]) + (" ..." if len(stats.non_finite_tensors) > 8 else "")
    _NON_FINITE_LOG.warning("non-finite", "rank %d: step %d: the gradient of %s was not finite (NaN/Inf); every "
                            "rank sees it as NaN (a GradScaler skips the step; without one, training has "
                            "diverged)", rank, stats.step, names)
