"""Auto mode's uncompressed steps through a native collective: ``torch.distributed`` all_reduce,
block by block, as backward completes them (``DistributedOptimizer``'s side of "never slower
than DDP"; the DDP hook averages its buckets with DDP's own allreduce instead).

On a link fast enough that compression does not pay, the shards' fp32 path (push, sum on the
shard, pull, all through Python gRPC) costs more than a ring all_reduce of the same bytes. So
when a process group is there, the steps auto mode sends uncompressed average each block with
all_reduce on it::

    collective = BlockAllreduce.open(pipe, group, names)  # once: checks the group (a collective)
    collective.ready(pipe.tensors_ready(names), grad_of)  # backward: launches the blocks whose turn it is
    collective.ready(pipe.take_unsubmitted(), grad_of)    # end of backward: the rest (zeros)
    collective.wait()                                     # every block averaged, or the error
    pipe.step_done_elsewhere(...)                         # the step counted; no shard round used

Order. gloo and NCCL match collectives by the order each rank issues them, so every rank must
launch the same blocks in the same order, whatever order its hooks fire in. As DDP does with its
buckets (each launched only after the ones before it), the blocks go in one fixed
``launch_order``, the same on every rank: the reverse registration order of each block's earliest
tensor, which is about the order backward completes them, so communication overlaps backward.
A block ready before its turn waits for the ones ahead of it. ``open`` checks once, with a
small all_gather, that the group holds exactly this job's ranks and that they agree on the order.

Memory. A block whose gradients lie end to end in one float32 ``.grad`` is averaged in place
there (no copy); the others in the pipeline's block buffer (copied in by ``take_in``, out by
``copy_out``). Divide, then sum (as torch's ``allreduce_hook``; with 2^k ranks the division is
exact, and every rank receives the same bytes).

Intra-node ranks: the group holds every rank of the job, so each rank takes part with its own
gradient and the node's shared-memory reduction is skipped on such a step; its step counters
stay where they are (as the shards' rounds do), and the owner of a block still waits until its
peers took the last shard result from its buffer before writing into it (``take_in``).

NaN/Inf pass through the sum to every rank, so a rank's overflow reaches every rank's
GradScaler; without ``allow_non_finite``, ``wait`` raises on every rank, naming the tensors.

A stalled rank. The shards fail a round after their round timeout, naming the node; the
group's own timeout is far longer (gloo: 30 minutes) and names no rank. So on a gloo group
``wait`` gives each step the same round timeout: then ``CollectiveStalledError``, naming the
block, the step and the group. That is fatal for this rank: torch cannot cancel a collective
(``Work.wait(timeout)`` only stops waiting), so the stalled all_reduce stays queued on the
group, pairs with whatever the late rank sends next and writes into the gradients when it
does; the collective refuses every later use with the same error. NCCL's ``wait`` does not
block the CPU (it orders the CUDA stream), so there the group's watchdog timeout applies.
"""

from __future__ import annotations

import threading
import time
import zlib
from datetime import timedelta
from typing import Iterable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ...v1 import ps_pb2
from ..pipeline.buffers import TensorOf
from ..errors import CgxPsError, CollectiveStalledError, ConfigError
from ..pipeline.block_pipeline import BlockPipeline

__all__ = ["BlockAllreduce", "WaitOutcome", "allreduce_rate", "group_problem",
           "group_size_problem", "launch_order"]


def allreduce_rate(group: "dist.ProcessGroup", nbytes: int) -> float:
    """Bytes all-reduced per second on the group, for auto mode's model: a collective, so every
    rank calls it at the same step. A one-element all_reduce first lines the ranks up, so the
    timed one does not count another rank's lateness."""
    device = _device_for(group)
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    local = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    start = time.perf_counter()
    dist.all_reduce(local, group=group)
    if local.is_cuda:
        torch.cuda.synchronize(local.device)
    return local.numel() * 4 / max(time.perf_counter() - start, 1e-9)


def _device_for(group: "dist.ProcessGroup") -> torch.device:
    """NCCL reduces GPU tensors only; gloo, CPU tensors (and GPU ones, through copies)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launch_order(layout: ps_pb2.Layout, registration_order: Sequence[str]) -> list[int]:
    """The blocks in the order every rank launches them: a block is complete when its earliest
    registered tensor's gradient arrives, and backward produces gradients about in reverse
    registration order (DDP's first bucket order rests on the same assumption); ties (the blocks
    of one large tensor) in block order."""
    index = {name: i for i, name in enumerate(registration_order)}
    earliest = {b.block_id: min(index[layout.tensors[s.tensor_index].name] for s in b.segments)
                for b in layout.blocks}
    return sorted(earliest, key=lambda b: (-earliest[b], b))


def group_size_problem(group_size: int, world_size: int) -> str | None:
    """Why a group of ``group_size`` ranks cannot average a job of ``world_size``, or None: the
    one check that needs no collective, so a front end can make it when it is created."""
    if group_size != world_size:
        return (f"the process group has {group_size} ranks, this cgx-ps job {world_size}: pass a process_group "
                f"of every worker (or uncompressed_via='shards')")
    return None


def group_problem(mine: Sequence[int], gathered: Sequence[Sequence[int]], world_size: int) -> str | None:
    """Why the group cannot average this job's gradients, or None. Each rank contributes
    (its cgx-ps rank, a hash of its launch order, a hash of the shards' session id)."""
    ranks = sorted(int(g[0]) for g in gathered)
    if ranks != list(range(world_size)):
        return (f"the process group holds cgx-ps ranks {ranks}, not this job's {world_size} ranks 0..{world_size - 1}: "
                f"pass a process_group of every worker (or uncompressed_via='shards')")
    if any(int(g[2]) != mine[2] for g in gathered):
        return "the process group's ranks belong to different cgx-ps sessions (another job's processes?)"
    if any(int(g[1]) != mine[1] for g in gathered):
        return ("the ranks list their parameters in different orders (named_parameters): every rank must wrap the "
                "same model the same way, or their all_reduce calls would not match")
    return None


class BlockAllreduce:
    """Averages the blocks of a step over a process group, each launched in its turn (module doc)."""

    def __init__(self, pipe: BlockPipeline, group: "dist.ProcessGroup", order: Sequence[int],
                 timeout_s: float | None = None) -> None:
        self.pipe, self.group, self.order = pipe, group, list(order)
        self.size = dist.get_world_size(group)
        # how long a step waits for its all_reduces (None: the group's own timeout; module doc)
        self.timeout_s = timeout_s
        self.stalled: CollectiveStalledError | None = None  # once set, the group is out of step for good
        self._lock = threading.Lock()  # hooks may fire on several autograd threads
        # this step: blocks complete, how many of ``order`` are launched, the launched ones in flight
        self._ready: set[int] = set()
        self._launched = 0
        self._in_flight: list[tuple[int, torch.Tensor, dist.Work]] = []

    @classmethod
    def open(cls, pipe: BlockPipeline, group: "dist.ProcessGroup", registration_order: Sequence[str]
             ) -> "BlockAllreduce":
        """Check the group and build the launch order; a collective on the group, so every rank
        calls it at the same step (auto mode's first decision, or its first uncompressed step)."""
        problem = group_size_problem(dist.get_world_size(group), pipe.config.world_size)
        if problem is not None:  # checked here first: no collective to hang in
            raise ConfigError(f"rank {pipe.config.rank}: {problem}")
        order = launch_order(pipe.layout, registration_order)
        mine = [pipe.config.rank, zlib.crc32(",".join(map(str, order)).encode()),
                zlib.crc32(pipe.session_id.encode())]
        local = torch.tensor(mine, dtype=torch.int64, device=_device_for(group))
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        problem = group_problem(mine, [g.tolist() for g in gathered], pipe.config.world_size)
        if problem is not None:
            raise ConfigError(f"rank {pipe.config.rank}: {problem}")
        gloo = "gloo" in str(dist.get_backend(group)).lower()  # NCCL's wait does not block the CPU
        return cls(pipe, group, order, pipe.round_timeout_s if gloo else None)

    def ready(self, blocks: Iterable[int], grad_of: TensorOf) -> None:
        """These blocks' gradients are final (``pipe.tensors_ready``): launch every block whose
        turn has come."""
        if self.stalled is not None:
            raise self.stalled
        with self._lock:
            self._ready.update(blocks)
            while self._launched < len(self.order) and self.order[self._launched] in self._ready:
                self._launch(self.order[self._launched], grad_of)
                self._launched += 1

    def _launch(self, block_id: int, grad_of: TensorOf) -> None:
        work = self.pipe.take_in(block_id, grad_of, in_place=True)
        work.div_(self.size)  # before the sum, as torch's allreduce_hook: no overflow in half precision
        self._in_flight.append((block_id, work, dist.all_reduce(work, group=self.group, async_op=True)))

    def wait(self, allow_non_finite: bool) -> None:
        """Wait for every block (all must have been launched); the averages are in the memory
        ``take_in`` gave (``pipe.copy_out`` writes them to the front end). Raises, ready for the
        next step, if a block's all_reduce failed or, without ``allow_non_finite``, its average
        is not finite (then on every rank alike)."""
        if self.stalled is not None:
            raise self.stalled
        with self._lock:
            in_flight, launched = self._in_flight, self._launched
            self._ready, self._launched, self._in_flight = set(), 0, []
        # all of them, even after a failure: none may write later (but a stalled one stays)
        failed = _wait_all(in_flight, self.timeout_s)
        rank = self.pipe.config.rank
        if failed is not None and failed.stalled:
            self.stalled = self._stalled_error(failed.block_id)
            raise self.stalled
        if failed is not None:
            block_id, exc = failed.block_id, failed.error  # a rank died or left: a reset connection, gloo's timeout
            raise CgxPsError(f"rank {rank}: the all_reduce of block {block_id} failed on the process group: "
                             f"{exc}") from exc
        if launched < len(self.order):
            raise CgxPsError(f"rank {rank}: {len(self.order) - launched} block(s) never launched "
                             f"(take_unsubmitted() gives the blocks still waiting)")
        if not allow_non_finite:
            for block_id, work, _ in in_flight:
                # a finite sum has only finite terms: one pass, no mask (a sum that overflowed is
                # told apart by the exact check)
                if not bool(torch.isfinite(work.sum())) and not bool(torch.isfinite(work).all()):
                    raise self.pipe.gradient_error(block_id, "NaN/Inf (on some rank) in the gradient of")

    def _stalled_error(self, block_id: int) -> CollectiveStalledError:
        return CollectiveStalledError(
            f"rank {self.pipe.config.rank}: the all_reduce of block {block_id} at step {self.pipe.steps} did not "
            f"finish within the round timeout ({self.timeout_s:g}s) on the process group of {self.size} ranks: "
            f"another rank stalled (hung, or stopped before this step's backward; its own log says which). This "
            f"rank cannot go on: torch cannot cancel the all_reduce, so the group is out of step and a late one "
            f"may still write into the gradients. Stop every rank and restart the job from a checkpoint; if the "
            f"ranks are only slow, raise the shards' --round-timeout, or use uncompressed_via='shards'")

    def abort(self) -> None:
        """Forget this step (after an error elsewhere). What is in flight is waited for first (up to
        the round timeout), as it writes into the gradients the next step takes in; if ranks
        parted ways, the group fails it at its timeout."""
        with self._lock:
            in_flight = self._in_flight
            self._ready, self._launched, self._in_flight = set(), 0, []
        if self.stalled is None:
            failed = _wait_all(in_flight, self.timeout_s)
            if failed is not None and failed.stalled:
                self.stalled = self._stalled_error(failed.block_id)


class WaitOutcome(NamedTuple):
    """The first all_reduce of a step that failed: its block, the error, and whether it is still
    running (stalled: waited for up to the timeout) rather than failed by the backend."""

    block_id: int
    error: Exception
    stalled: bool


def _wait_all(in_flight: Sequence[tuple[int, torch.Tensor, "dist.Work"]], timeout_s: float | None
              ) -> WaitOutcome | None:
    """Wait for every all_reduce in flight, all of them within ``timeout_s`` (None: the group's
    own timeout); the first failure, or None. After a stall the rest are not waited for: they
    are queued behind it on the group."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed = None
    for block_id, _, handle in in_flight:
        try:
            if deadline is None:
                handle.wait()
            else:  # at least 1 ms: a zero timedelta means "no timeout" to torch
                handle.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception as exc:  # noqa: BLE001 - the backend's errors have no common type; reported by the caller
            if not handle.is_completed():  # "Operation timed out!": still queued on the group
                return WaitOutcome(block_id, exc, stalled=True)
            failed = failed or WaitOutcome(block_id, exc, stalled=False)
    return failed
