"""How a step of the block pipeline ends: ``finish_step`` waits for every block and measures the
step, ``step_done_elsewhere`` counts a step averaged without the shards, ``abort_step`` forgets
one after an error, and ``abandon_step`` gives one up on every rank (a backward that failed part
way): the blocks this rank had not pushed go as the marker of an abandoned step
(``block_exchange.abandoned_result``) and every other rank's ``finish_step`` raises
``StepAbandoned``. ``BlockPipeline`` (block_pipeline.py) takes these from ``StepEnd``.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

from ... import timeline
from ...kernels import CodecError
from ..errors import CgxPsError, StepAbandoned
from .block_exchange import abandoned_step_counts
from ..frontends.stepstats import StepStats

if TYPE_CHECKING:
    from ..config import WorkerConfig
    from .arrivals import StepArrivals
    from .block_exchange import BlockExchange, BlockState
    from .buffers import BlockBuffers
    from ..frontends.stepstats import CommSpan

__all__ = ["StepEnd"]


class StepEnd:
    """The end of a step, mixed into ``BlockPipeline`` (see the module doc)."""

    # what it reads of the pipeline (block_pipeline.py sets them)
    config: WorkerConfig
    steps: int
    stats: StepStats
    buffers: BlockBuffers
    arrivals: StepArrivals
    _blocks: list[BlockState]
    _exchange: BlockExchange
    _lock: threading.Lock
    _span: CommSpan
    _reducer: object | None
    _to_shards: bool
    compressing: bool  # a property of the pipeline's, as is submit()

    def finish_step(self, backward_s: float = 0.0, waiting_since: float | None = None) -> StepStats:
        """Wait for every block of the step, then start the next step. Raises the first block's
        error; a gradient the codec refuses (NaN/Inf) is named. ``backward_s``: the front end's
        first to last gradient of the step (auto mode's overlap). ``waiting_since``: when the
        front end began to wait for communication (``time.perf_counter()``; default: now), the
        start of the step's exposed communication."""
        if not self.arrivals.all_submitted():
            self.abort_step()
            raise CgxPsError("finish_step() before every block was submitted (take_unsubmitted() gives the rest)")
        t0 = time.perf_counter() if waiting_since is None else waiting_since
        waited = timeline.mark()
        stats = StepStats(step=self.steps, compressed=self.compressing, backward_s=backward_s,
                          in_place_blocks=sum(b.in_place for b in self._blocks), arrivals=self.arrivals.times())
        try:
            for block in self._blocks:
                try:
                    pushed = block.future.wait()
                except CodecError as exc:  # e.g. NaN/Inf in a gradient: say whose
                    raise self.gradient_error(block.spec.block_id, "cannot encode the gradient of", str(exc)) from exc
                except StepAbandoned as exc:
                    raise StepAbandoned(
                        f"rank {self.config.rank}: step {self.steps} was abandoned by another rank (a backward that "
                        f"failed there, or a gradient there that was not finite: {exc}): no rank applies it. To go on as that rank does, catch "
                        f"StepAbandoned, call zero_grad() and train on the next batch") from None
                stats.bytes_pushed += pushed
                stats.fp32_bytes += 4 * block.spec.numel if pushed else 0
        except Exception:
            # The step's other blocks may still be on their way, and would write their averages
            # where the next step's gradients go: let them end first (each within the round timeout).
            self._drain()
            self.abort_step()
            raise
        except BaseException:
            # Ready for the next step: a caller that skips this one (a loss-scaler after NaNs) or
            # an interrupted notebook cell must not find this step's stale futures again.
            self.abort_step()
            raise
        stats.exposed_comm_s = max(0.0, time.perf_counter() - t0)
        stats.non_finite_tensors = tuple(sorted({name for b in self._blocks if b.non_finite
                                                 for name in self.buffers.tensors_in(b.spec.block_id)}))
        stats.non_finite_average = any(b.result_non_finite for b in self._blocks)
        timeline.since(waited, "exposed wait", stats.step)
        stats.comm_window_s = self._span.take()
        self.stats, self.steps = stats, self.steps + 1
        self._next_step()
        return stats

    def gradient_error(self, block_id: int, problem: str, detail: str = "") -> CgxPsError:
        """The error for a block whose gradient cannot be averaged (NaN/Inf without
        ``allow_non_finite``): "rank R: <problem> <the block's tensors>: <detail>. <what to do>"."""
        names = ", ".join(sorted(set(self.buffers.tensors_in(block_id))))
        return CgxPsError(f"rank {self.config.rank}: {problem} {names}{': ' + detail if detail else ''}. "
                          f"With mixed precision (a GradScaler), "
                          f"pass allow_non_finite=True: every rank then sees the overflow and the scaler skips the "
                          f"step everywhere")

    def step_done_elsewhere(self, backward_s: float, waiting_since: float) -> StepStats:
        """Count a step whose gradients were averaged without the shards (auto mode's uncompressed
        steps through a native allreduce: the DDP hook's buckets, ``uncompressed.BlockAllreduce``'s
        blocks taken in with ``take_in``): no block went to the shards, no round is used (the
        shards' round counters continue where they stopped), the tuner sees a step."""
        if self._to_shards:
            self.abort_step()
            raise CgxPsError("a step is averaged either through the shards or elsewhere, not both")
        stats = StepStats(step=self.steps, compressed=False, backward_s=backward_s, path="allreduce",
                          exposed_comm_s=max(0.0, time.perf_counter() - waiting_since),
                          in_place_blocks=sum(b.in_place for b in self._blocks), arrivals=self.arrivals.times())
        self.stats, self.steps = stats, self.steps + 1
        self._next_step()
        return stats

    def abort_step(self) -> None:
        """Forget this step's arrivals and futures (after an error, before a step is retried)."""
        self._next_step()

    def abandon_step(self) -> StepStats | None:
        """Give up the step under way on this rank (its backward failed part way) so that every
        rank stays in step: the blocks not yet pushed are pushed as non-finite blocks, the
        marker of an abandoned step (``blockexchange.abandoned_result``), so every block's round
        completes on the shards and every other rank's step fails with ``StepAbandoned`` (with
        ``allow_non_finite``: ends non-finite); then the results are waited for (within the round
        timeout), dropped, and the next step starts. Every block's round has then moved on by one
        on every rank, and the step counter too where the others count the step
        (``abandoned_step_counts``): then its stats are returned, else None.

        Raises CgxPsError: changing nothing where ``why_not_abandon()`` says why; and a shard's
        error from one of the step's blocks once the rest are done."""
        problem = self.why_not_abandon()
        if problem is not None:
            raise CgxPsError(problem)
        stats = StepStats(step=self.steps, compressed=self.compressing)  # before the counter may move
        for block_id in self.arrivals.take_rest():
            self.submit(block_id, lambda name: None, abandon=True)
        error = self._drain()
        self.abort_step()
        if error is not None:
            raise error
        if not abandoned_step_counts(self._exchange.allow_non_finite):
            return None
        self.stats, self.steps = stats, self.steps + 1
        return stats

    def why_not_abandon(self) -> str | None:
        """Why the step under way cannot be abandoned, or None. Refused, nothing changes: the
        step stays as it is (a reset would let this rank's next pushes pair with the other
        ranks' pushes of another step)."""
        if self._reducer is not None:  # a peer's marker would have to reach the block's owner on the node
            return (f"rank {self.config.rank}: step {self.steps} cannot be abandoned with "
                    f"{self.config.local_world_size} local ranks on the node (they reduce their gradients "
                    f"together): stop every rank and restart from a checkpoint")
        if self.arrivals.all_submitted():  # the other ranks get complete results and apply it
            return (f"rank {self.config.rank}: step {self.steps} cannot be abandoned: every gradient had reached "
                    f"the shards before the backward failed, so the other ranks apply this step. Call step() to "
                    f"apply it here too (its gradients are complete)")
        return None

    def _drain(self) -> Exception | None:
        """Wait for every block this step submitted; the first error other than an abandoned
        step's (that the step is abandoned is known) or this rank's codec refusing its gradient
        (that block went as the marker: its round is done, and the step is given up anyway)."""
        first = None
        with self._lock:
            futures = [b.future for b in self._blocks]
        for future, submitted in zip(futures, self.arrivals.submitted()):
            if not submitted:
                continue
            try:
                future.wait()
            except (StepAbandoned, CodecError):
                pass
            except Exception as exc:  # noqa: BLE001 - kept to raise once every block is done
                first = first or exc
        return first

    def _next_step(self) -> None:
        self.arrivals.reset()
        with self._lock:
            self._to_shards = False
            for block in self._blocks:
                block.future, block.in_place = torch.futures.Future(), False
                block.non_finite = block.result_non_finite = False
