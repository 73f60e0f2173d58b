"""What both front ends share around the block pipeline: their options, the step's timing,
and the work after a step (the tuner, metrics).

``DistributedOptimizer`` (a hook per parameter, ``.grad``) and the DDP communication hook (a
future per DDP bucket) differ only in where gradients come from and go to. Each holds a
``StepDriver``:

    driver.gradient_arrived()                # each hook call: the step's timing; the last
                                             # step's after-work if nobody ran it yet
    driver.submit_ready(names, grad_of[, out_of])  # these tensors are final: start their full
                                             # blocks (in place on grad_of's memory where it allows:
                                             # leave those tensors alone until the block is done;
                                             # out_of: where the averages go, if not there)
    driver.submit_rest(grad_of[, out_of])    # end of backward: the blocks still waiting (zeros)
    driver.finish(waiting_since)             # every block done: the step's stats
    driver.finish_elsewhere(waiting_since)   # or: the step was averaged without the shards
    driver.after_step()                      # the tuner (its broadcast blocks) and metrics
    driver.abandon()                         # or: give the step up on every rank (a failed
                                             # backward; BlockPipeline.abandon_step)

On auto mode's uncompressed steps, ``uncompressed_path`` sends a step past the shards when a
process group is there: the DDP hook averages its buckets with DDP's allreduce (then
``finish_elsewhere``); the optimizer passes a ``collective.BlockAllreduce`` as ``collective`` to
``submit_ready``, ``submit_rest``, ``finish`` and ``abort``, and its blocks go there instead.
Either way the front end gives the driver a probe of that path (``collective.allreduce_rate`` on
the same group), so auto mode's model sees both of its choices in both front ends.

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
from typing import TYPE_CHECKING, Callable, Sequence

from ...rate_limited_log import RateLimitedLog
from ...v1 import ps_pb2
from ..tuning.tuner import Decision, Tuner
from ..pipeline.buffers import TensorOf
from ..errors import CheckpointError, ConfigError
from ..pipeline.blocks import DEFAULT_BLOCK_BYTES, Compression
from ..metrics import after_step as export_step_metrics
from ..pipeline.block_pipeline import BlockPipeline, PipelineSpec, StepStats

log = logging.getLogger(__name__)
# one line a minute at most: a diverged run has non-finite gradients every step, a GradScaler's
# overflows come in runs at the start; the metric counts every one of them
_NON_FINITE_LOG = RateLimitedLog(log, burst=1, window_s=60.0)

if TYPE_CHECKING:
    from .uncompressed import BlockAllreduce

__all__ = ["StepDriver", "SyncOptions", "UNCOMPRESSED_VIA", "probe_problem", "uncompressed_path"]

# where auto mode's uncompressed steps go: a native allreduce on a process group (when there is
# one), or the shards' fp32 path
UNCOMPRESSED_VIA = ("allreduce", "shards")


def uncompressed_path(compress: bool, via: str, group_available: bool) -> str:
    """How this step's gradients are averaged: "shards" (the block pipeline, compressed or not) or
    "allreduce" (auto mode's uncompressed steps, when a process group is there: DDP's own for the
    hook, ``collective.BlockAllreduce`` for the optimizer). Every rank applies auto mode's decision
    (``compress``) at the same step boundary, so every rank takes the same path."""
    return "allreduce" if not compress and via == "allreduce" and group_available else "shards"


def probe_problem(auto: bool, via: str, has_probe: bool) -> str | None:
    """Why a front end cannot run auto mode as configured, or None. Auto mode's model judges the
    uncompressed path by a probe of it; a front end whose uncompressed steps may skip the shards
    (``via="allreduce"``) and gives no probe would leave the model blind to the path it takes, so
    there is no such front end: one mechanism for every front end (``automode``'s module doc)."""
    if auto and via == "allreduce" and not has_probe:
        return ("auto mode with uncompressed_via='allreduce' needs the front end's probe of that all_reduce "
                "(a front end without one must use uncompressed_via='shards')")
    return None


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

    def __init__(self, pipe: BlockPipeline, options: SyncOptions,
                 uncompressed_probe: Callable[[int], float | None] | None = None) -> None:
        """``uncompressed_probe``: for auto mode, the all_reduce rate of the path the front end's
        uncompressed steps take, or None when they go through the shards (``autotune.Tuner``);
        every front end that may send them past the shards gives one (``open_together`` checks)."""
        self.pipe, self.options = pipe, options
        compression = options.compression
        self.tuner = Tuner(pipe, compression, uncompressed_probe) if compression.adaptive or compression.auto else None
        # blocks whose gradients lie end to end in the front end's memory (a slice of one .grad,
        # a DDP bucket) are encoded from and decoded into it, not copied through the block
        # buffers, unless the node reduces through its buffers or adaptive bits' tuner reads them
        # (auto mode reads only step figures: its compressed steps work in place too)
        self.in_place = pipe.in_place(tuned=compression.adaptive)
        self._lock = threading.Lock()  # gradients may arrive on several autograd threads
        self._first: float | None = None  # this step's first gradient
        self._last = 0.0  # and its latest
        self._after_pending = False  # a step finished and its after-work has not run

    @classmethod
    def open_together(cls, named_tensors_per_model: list, options: list[SyncOptions],
                      uncompressed_probes: Sequence[Callable[[int], float | None] | None] | None = None
                      ) -> list["StepDriver"]:
        probes = uncompressed_probes or [None] * len(options)
        for o, probe in zip(options, probes):  # before registering with the shards
            problem = probe_problem(o.compression.auto, o.uncompressed_via, probe is not None)
            if problem is not None:
                raise ConfigError(problem)
        pipes = BlockPipeline.open_together([o.spec(t) for t, o in zip(named_tensors_per_model, options)])
        return [cls(p, o, probe) for p, o, probe in zip(pipes, options, probes)]

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

    def submit_ready(self, names, grad_of: TensorOf, out_of: TensorOf | None = None,
                     collective: BlockAllreduce | None = None) -> list[int]:
        """Start the blocks these tensors complete; returns them."""
        blocks = self.pipe.tensors_ready(names)
        self._start(blocks, grad_of, out_of, collective)
        return blocks

    def submit_rest(self, grad_of: TensorOf, out_of: TensorOf | None = None,
                    collective: BlockAllreduce | None = None) -> None:
        self._start(self.pipe.take_unsubmitted(), grad_of, out_of, collective)

    def _start(self, blocks: list[int], grad_of: TensorOf, out_of: TensorOf | None,
               collective: BlockAllreduce | None) -> None:
        if collective is not None:  # this step is averaged on a process group, not the shards
            collective.ready(blocks, grad_of)
            return
        for block in blocks:
            self.pipe.submit(block, grad_of, self.in_place.allowed, out_of)

    def finish(self, waiting_since: float | None = None, collective: BlockAllreduce | None = None) -> StepStats:
        """Wait for every block (raises the first error, the step aborted), end the step."""
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
            self._first = None
        stats = end(backward_s)
        with self._lock:
            self._after_pending = True
        return stats

    def abandon(self) -> None:
        """This rank gives up the step under way: every rank's step fails with StepAbandoned,
        this one's quietly (``BlockPipeline.abandon_step``); the next gradient starts a new one.
        Where the other ranks count the step (``allow_non_finite``), the tuner sees it here too."""
        try:
            counted = self.pipe.abandon_step() is not None
        finally:
            with self._lock:
                self._first = None
        if counted:
            with self._lock:
                self._after_pending = True

    def abort(self, collective: BlockAllreduce | None = None) -> None:
        """Forget this step (after an error): the next gradient starts a new one."""
        if collective is not None:
            collective.abort()
        self.pipe.abort_step()
        with self._lock:
            self._first = None

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

    # ---- what the front ends show ------------------------------------------------------------

    @property
    def stats(self) -> StepStats:
        return self.pipe.stats

    @property
    def layout(self) -> ps_pb2.Layout:
        return self.pipe.layout

    @property
    def intranode(self) -> str | None:
        return self.pipe.intranode

    @property
    def tuning_history(self) -> list[Decision]:
        return list(self.tuner.history) if self.tuner is not None else []


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
