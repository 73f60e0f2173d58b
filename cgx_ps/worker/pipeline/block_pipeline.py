"""One block pipeline for every front end: the per-block work of a training step.

A front end owns the gradients and knows when they are final: ``DistributedOptimizer`` (a hook
per parameter, ``.grad``) or the DDP communication hook (a flat tensor per DDP bucket).
It feeds the pipeline blocks of the layout (``build_layout``: the same blocks on every worker)
and takes the averaged gradients back, through a handful of calls::

    pipe = BlockPipeline.open(named_tensors, compression, block_bytes)
    for b in pipe.tensors_ready(["fc.weight"]):   # these tensors' gradients are final this step
        pipe.submit(b, grads.get)                 # copy block b in, start it; returns pipe.future(b)
    for b in pipe.take_unsubmitted():             # end of backward: blocks still waiting for
        pipe.submit(b, grads.get)                 # tensors that got no gradient (zeros)
    stats = pipe.finish_step(backward_s)          # every block done, or an error naming the cause
    for b in range(pipe.num_blocks):
        pipe.copy_out(b, out.get)                 # the averaged gradient into the front end's tensors

A rank whose backward failed part way gives the step up with ``pipe.abandon_step()`` instead of
``finish_step``: the blocks it has not pushed go as non-finite blocks, and every other rank's
``finish_step`` raises ``StepAbandoned`` (``blockexchange.abandoned_result``).

``submit(b, grads.get, in_place=True)`` (where ``in_place()`` allows it) skips the copy in and
out for a block whose gradients lie end to end in one float32 tensor: it is encoded from that
memory and decoded into it (``buffers.py``).

Between ``submit`` and its future, the block's exchange runs on the communication thread
(``pipeline/block_exchange.py``): local sum, encode, push, pull, decode, share with the node's other ranks.

The DDP hook (``ddp_hook.py``) drives it per bucket; the tuner (``tuning/tuner.py``) runs on the
training thread. Both front ends share their step bookkeeping through ``frontends/step_driver.py``.

``allow_non_finite`` (mixed precision): a block holding NaN/Inf travels as a non-finite block
(the header alone) and every rank decodes NaN for it, so a loss scaler skips the step on every
rank; without it the step fails, naming the tensors.
Beside it: ``step_end.py`` (how a step ends: ``finish_step``, ``abandon_step``), ``stepstats.py`` (what
``finish_step`` measured), ``checkpoint_state.py`` (checkpoints).
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ... import timeline
from ...kernels import ErrorFeedback
from ...kernels.warm import warm_in_background
from ...v1 import ps_pb2
from .arrivals import StepArrivals
from .block_exchange import BlockExchange, BlockState
from .catch_up import StepPace, missed_rounds
from .shadow import shadow_rounds
from .buffers import BlockBuffers, InPlace, TensorOf, work_in_place
from ..config import WorkerConfig
from ..shards.engine import CommEngine, EngineShare
from ..errors import CgxPsError
from ..gpu_setup import compile_cuda_codecs
from ..intranode.reduction import node_reducer
from .blocks import Compression, TensorInfo, build_layout
from .checkpoint_state import pipeline_state, restore
from .step_end import StepEnd
from ..runtime import current_config, engines_for_layouts
from ..frontends.stepstats import CommSpan, StepStats

__all__ = ["BlockPipeline", "PipelineSpec", "StepStats"]


@dataclass(frozen=True)
class PipelineSpec:
    """What ``BlockPipeline.open_together`` needs for one model."""

    named_tensors: Sequence[tuple[str, torch.Tensor]]
    compression: Compression
    block_bytes: int
    options: Mapping[str, object] = field(default_factory=dict)  # error_feedback, warmup_steps, allow_non_finite


class BlockPipeline(StepEnd):
    """The per-block exchange of one process (see the module doc); also the ``Tunable`` that
    ``autotune.Tuner`` reads and adjusts."""

    def __init__(self, layout: ps_pb2.Layout, engine: CommEngine | EngineShare, config: WorkerConfig,
                 devices: Mapping[str, torch.device], *, error_feedback: bool = False, warmup_steps: int = 0,
                 allow_non_finite: bool = False) -> None:
        self.layout, self.config, self.warmup_steps = layout, config, warmup_steps
        self.compress = True  # auto mode may turn compression off (all ranks at once)
        self.steps = 0  # finished steps
        self.stats = StepStats()
        self._engine = engine
        self._pace = StepPace()  # quorum rounds' catch-up (catch_up.py)
        # NVRTC or a missing CuPy fails here, at setup, not at the first max-min gradient
        block_devices = [devices[layout.tensors[b.segments[0].tensor_index].name] for b in layout.blocks]
        compile_cuda_codecs([b.codec.codec for b in layout.blocks], block_devices)
        # and the CPU kernels of the widths in use compile while the job sets up (kernels/warm.py)
        cpu_widths = {b.codec.bits for b, d in zip(layout.blocks, block_devices)
                      if d.type == "cpu" and b.codec.codec == ps_pb2.CODEC_MAXMIN}
        if cpu_widths:
            warm_in_background(sorted(cpu_widths), "worker")
        self._exchanged = False  # a block went to the shards in this session (a resume must come first)
        self._to_shards = False  # a block went to the shards in this step
        self._reducer = node_reducer(layout, config, set(devices.values()), engine.round_timeout_s,
                                     run_tag=engine.session_id)
        self._lock = threading.Lock()  # the step's futures and flags, reset between steps
        self._span = CommSpan()
        self._exchange = BlockExchange(engine, self._reducer, config, self._span, allow_non_finite)
        self.buffers = BlockBuffers(layout, block_devices, self._reducer)
        self._blocks = [BlockState(spec, self.buffers[spec.block_id], spec.codec,
                                   ErrorFeedback() if error_feedback else None, self.buffers[spec.block_id],
                                   self.buffers[spec.block_id]) for spec in layout.blocks]
        self.arrivals = StepArrivals([self.buffers.tensors_in(spec.block_id) for spec in layout.blocks])

    @classmethod
    def open(cls, named_tensors: Sequence[tuple[str, torch.Tensor]], compression: Compression, block_bytes: int,
             **options) -> "BlockPipeline":
        """Lay the tensors out in blocks, register the layout with every shard and set up the
        node's intra-node reduction; ``options``: ``error_feedback``, ``warmup_steps``,
        ``allow_non_finite``."""
        return cls.open_together([PipelineSpec(list(named_tensors), compression, block_bytes, options)])[0]

    @classmethod
    def open_together(cls, specs: Sequence["PipelineSpec"]) -> list["BlockPipeline"]:
        """One pipeline per spec (several models of one process), registered with the shards as
        one session: the process's one engine carries them all."""
        num_shards = len(current_config().servers)
        layouts = [build_layout([TensorInfo.of(n, t) for n, t in spec.named_tensors], num_shards, spec.compression,
                                spec.block_bytes, bool(spec.options.get("allow_non_finite", False))) for spec in specs]
        engines, config = engines_for_layouts(layouts)
        return [cls(layout, engine, config, {n: t.device for n, t in spec.named_tensors}, **spec.options)
                for layout, engine, spec in zip(layouts, engines, specs)]

    # ---- the front ends' side ----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def intranode(self) -> str | None:
        """How this node's local ranks reduce: "shm", "cuda", or None (alone on the node)."""
        return self._reducer.transport if self._reducer is not None else None

    @property
    def session_id(self) -> str:
        """The shards' id of this job's session (the same on every rank of the job)."""
        return self._engine.session_id

    @property
    def round_timeout_s(self) -> float:
        """The shards' round timeout: how long a step's exchange may wait for the other ranks."""
        return self._engine.round_timeout_s

    def when_session_closes(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when ``cgx_ps.worker.shutdown()`` ends the session (``CommEngine.when_closed``)."""
        self._engine.when_closed(callback)

    def blocks_of(self, names: Iterable[str]) -> list[int]:
        """The blocks holding any of these tensors, in order."""
        return self.arrivals.blocks_of(names)

    def tensors_ready(self, names: Iterable[str]) -> list[int]:
        """These tensors' gradients are final for this step: the blocks to submit now
        (``arrivals.StepArrivals.ready``)."""
        return self.arrivals.ready(names)

    def waits_for(self, name: str) -> bool:
        """Whether a block holding this tensor is still to be submitted this step."""
        return self.arrivals.waits_for(name)

    def take_unsubmitted(self) -> list[int]:
        """The blocks not yet returned by ``tensors_ready`` this step (some of their tensors got
        no gradient); from now on they never will be: the caller submits them."""
        return self.arrivals.take_rest()

    def in_place(self, tuned: bool) -> InPlace:
        """Whether ``submit(..., in_place=True)`` may work on the front end's memory
        (``buffers.work_in_place``); ``tuned``: a tuner reads the block buffers after each step
        (adaptive bits)."""
        return work_in_place(self._reducer is not None, tuned)

    def submit(self, block_id: int, grad_of: TensorOf, in_place: bool = False,
               out_of: TensorOf | None = None, abandon: bool = False) -> torch.futures.Future:
        """Copy block ``block_id``'s gradients in (``grad_of(name)``: the tensor's gradient, or
        None for zeros) and start its exchange; returns ``future(block_id)``. ``in_place`` (only
        where ``in_place()`` allows it): where the block's gradients lie end to end in one float32
        tensor, encode from and decode into that memory instead, without copying; the front
        end must then leave them alone until the future completes, as DDP does its buckets.
        ``out_of`` (default ``grad_of``): where the average goes when it is not the gradient's own
        memory (the DDP hook decodes a fresh autograd gradient's average into DDP's bucket); with
        ``in_place``, decoded straight into it where its tensors lie end to end, else into the
        block buffer, and ``copy_out`` then copies it there. ``abandon`` (``abandon_step``): push
        the marker of an abandoned step instead, reading and writing none of the front end's memory."""
        block, reducer = self._blocks[block_id], self._reducer
        self._exchanged = True
        round_, seq = block.round, block.round - block.base + 1  # the job's round; the session's count
        timeline.step_begins(round_)
        hand_over = timeline.mark()
        self._to_shards = True
        if abandon:  # the marker is a header alone; its non-finite result lands in the block buffer
            block.work = block.result = block.buffer
            block.in_place = False
        else:
            self.take_in(block_id, grad_of, in_place and reducer is None, out_of)
        ready = None
        if block.work.is_cuda:  # the communication thread must not read the gradient before the copies ran
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(block.work.device))
        if reducer is not None:
            reducer.mark_ready(block_id, seq)
        work = self._exchange.work(block, round_, seq, ready, self.compressing, abandon)
        timeline.since(hand_over, "backward-ready", round_, block=block_id)
        running = self._engine.submit(timeline.traced(work, "block", round_, timeline.block_track(block_id),
                                                      block=block_id, shard=block.spec.shard))
        block.round += 1
        running.add_done_callback(lambda done, future=block.future: _settle(future, done))
        return block.future

    def take_in(self, block_id: int, grad_of: TensorOf, in_place: bool = False,
                out_of: TensorOf | None = None) -> torch.Tensor:
        """This step's gradient of the block as one flat float32 tensor: with ``in_place``, the
        front end's own memory where the block's gradients lie end to end in one float32 tensor
        (``buffers.span``), else the block buffer, copied in (``grad_of(name)``: the tensor's
        gradient, None for zeros). Its average is written there too, unless ``out_of`` says
        otherwise (``submit``). ``submit`` starts with it; a step averaged elsewhere
        (``uncompressed.BlockAllreduce``, no ``out_of``) averages what it returns."""
        block = self._blocks[block_id]
        span = self.buffers.span(block_id, grad_of) if in_place else None
        if span is None:
            if self._reducer is not None:  # the owner: peers took the last result from our buffer
                self._reducer.before_write(block_id, block.round - block.base + 1)
            self.buffers.fill(block_id, grad_of)
        out = span if out_of is None else self.buffers.span(block_id, out_of) if in_place else None
        block.work = block.buffer if span is None else span
        block.result = block.buffer if out is None else out
        block.in_place = span is not None and out is not None
        return block.work

    def future(self, block_id: int) -> torch.futures.Future:
        """Completes with the bytes this process pushed for the block (0: another local rank
        pushed it) once its averaged gradient is in its result memory (the block buffer, or the front
        end's own for an in-place block), or with the error."""
        return self._blocks[block_id].future

    def copy_out(self, block_id: int, out_of: TensorOf) -> None:
        """Write the block's averaged gradient into ``out_of(name)`` of each of its tensors
        (skipping those for which it returns None)."""
        block = self._blocks[block_id]
        if block.result is None:  # decoded into the front end's memory and written back: nothing to copy
            return
        with timeline.span("write-back", block.round - 1, block=block_id):
            self.buffers.copy_out(block_id, out_of, block.result)
        if block.result is not block.buffer:
            # the front end's memory (a .grad that zero_grad() sets to None) must not stay
            # allocated through the next forward and backward because a block still points at it
            block.result = None

    @property
    def compressing(self) -> bool:
        """Whether this step's blocks travel compressed: not during warm-up, nor when auto mode
        turned compression off."""
        return self.steps >= self.warmup_steps and self.compress

    # ---- what the tuner reads and changes (autotune.Tunable) -----------------------------------------

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def next_round(self) -> int:
        """The round the next step's blocks travel in."""
        return self._blocks[0].round if self._blocks else 0

    def missed_rounds(self) -> Iterator[int]:
        """Quorum rounds: each round this node missed, decoded into the block buffers when yielded,
        for the front end to apply (catch_up.py)."""
        return missed_rounds(self._blocks, self._engine, self._exchange, self.config, self._count_step, self._pace,
                             self._reducer)

    def shadow_rounds(self) -> Iterator[int]:
        """Uneven inputs, this node out of data: each round until every node has left, decoded
        into the block buffers when yielded, for the front end to apply (shadow.py)."""
        return shadow_rounds(self._blocks, self._engine, self._exchange, self._count_step)

    def _count_step(self) -> None:  # a round applied without a step of the front end's own
        self.steps += 1

    def settings(self, block_id: int) -> ps_pb2.CodecSettings:
        return self._blocks[block_id].settings

    def gradient(self, name: str) -> torch.Tensor:
        """A tensor's averaged gradient of the last step, flat (a view of the block buffers)."""
        return self.buffers.tensor(name)

    def probe(self, nbytes_per_shard: int) -> float:
        return self._engine.probe(nbytes_per_shard)

    def announce(self, from_round: int, changes: Mapping[int, ps_pb2.CodecSettings]) -> None:
        """Tell every shard the blocks' new settings from a round on (before any rank pushes it)."""
        self._engine.set_codecs(from_round, [ps_pb2.BlockCodec(block_id=b, codec=s) for b, s in changes.items()])

    def apply(self, compress: bool | None, changes: Mapping[int, ps_pb2.CodecSettings]) -> None:
        """From the next step on (between steps: nothing is in flight)."""
        if compress is not None:
            self.compress = compress
        for block_id, settings in changes.items():
            self._blocks[block_id].settings = settings

    # ---- checkpoints (pipeline/checkpoint_state.py): what a resumed job needs to continue bit for bit ----------

    def state_dict(self) -> dict:
        """This process's part of a checkpoint, between steps (``pipeline_state.pipeline_state``)."""
        return pipeline_state(self)

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from ``state_dict()`` before the first step (``pipeline_state.restore``);
        raises ``CheckpointError`` for another layout or a damaged state."""
        restore(self, state)


def _settle(future: torch.futures.Future, done: concurrent.futures.Future) -> None:
    if done.cancelled():
        future.set_exception(CgxPsError("the block's exchange was cancelled (the connection closed)"))
    elif done.exception() is not None:
        future.set_exception(done.exception())
    else:
        future.set_result(done.result())
