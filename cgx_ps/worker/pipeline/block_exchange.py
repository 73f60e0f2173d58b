"""One block's exchange with the shards, on the communication thread: what happens between
``BlockPipeline.submit`` and the block's future.

    exchange = BlockExchange(engine, reducer, config, span, allow_non_finite)
    work = exchange.work(block, round_, seq, ready, compressed)   # a coroutine for the engine

For one block and one round, the owner of the block among the node's local ranks waits until
every local rank wrote it and sums them (``NodeReducer``); encodes the sum (error feedback; a
seed from node, block and round; uncompressed during warm-up and when auto mode says so);
pushes it to the block's shard and pulls the aggregate of all nodes; decodes it, divides by the
world size, and publishes it to the other local ranks, which copy it (``fetch``). Every rank
decodes the same bytes: replicas stay bit-identical.

``BlockState`` is what the pipeline keeps of each block (its buffers, settings, round counter
and this step's bookkeeping); the exchange encodes from ``block.work`` (then points it back at
the block's buffer) and decodes into ``block.result``: the block buffers, or, for in-place
blocks, the front end's own memory (a ``.grad``, DDP's bucket).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Coroutine

import torch

from ... import timeline
from ...net.chunk_frames import PushFrames
from ...kernels import (HEADER_SIZE, Codec, CodecError, ErrorFeedback, PayloadScratch, contributors_of, dequantize,
                        encode_block, non_finite_block)
from ...model_layout import codec_of
from ...v1 import ps_pb2
from .cuda_streams import CODEC_STREAMS, CodecStreams
from ..config import WorkerConfig
from ..shards.engine import CommEngine, EngineShare
from ..errors import CgxPsError, StepAbandoned
from ..intranode.reduction import NodeReducer
from ..frontends.stepstats import CommSpan

__all__ = ["BlockExchange", "BlockState", "abandoned_result", "abandoned_step_counts", "average_scale", "block_seed"]


@dataclass(eq=False)
class BlockState:
    """One block of a pipeline, across steps."""

    spec: ps_pb2.BlockSpec
    buffer: torch.Tensor  # in BlockBuffers: the gradient in, the average out
    settings: ps_pb2.CodecSettings  # current codec settings (adaptive bits change them)
    feedback: ErrorFeedback | None  # worker-side error feedback, when asked for
    # where this step's gradient is encoded from (``buffer`` again once encoded), and where its
    # average is decoded into (None once an in-place block is written back: the step's .grad is
    # not kept past the step): ``buffer``, or the front end's own memory where the block's
    # tensors lie end to end there (``BlockPipeline.submit``)
    work: torch.Tensor
    result: torch.Tensor | None
    round: int = 0  # rounds submitted so far in the job: the next one's id (continues after a resume)
    base: int = 0  # the round this process's session began at: the intra-node flags count from it
    # this step's result (which blocks can start: ``arrivals.py``)
    future: torch.futures.Future = field(default_factory=torch.futures.Future)
    scratch: PayloadScratch = field(default_factory=PayloadScratch)  # the encoded payload, reused each round
    in_place: bool = False  # this step's work and result are the front end's memory: no copy in or out
    # this step's gradient had NaN/Inf and travelled as a non-finite block (allow_non_finite): what
    # a loss scaler's overflow looks like, and what a diverged run without one looks like too
    non_finite: bool = False
    # this step's average came back as a non-finite block (some rank's gradient had NaN/Inf): one
    # element read at decode, so a front end need not scan every gradient to know it
    result_non_finite: bool = False


def block_seed(node_rank: int, block_id: int, round_: int) -> int:
    """The stochastic rounding seed of a node's push of a block in a round: reproducible, and
    different for every node, block and round."""
    return zlib.crc32(f"{node_rank}/{block_id}/{round_}".encode())


def average_scale(result: bytes | memoryview, config: WorkerConfig) -> float:
    """What a block's result (a sum) is multiplied by to make the average: 1 / the world size, or,
    for a quorum round's result, 1 / its header's contributors (the nodes in time, each the sum of
    its local ranks; late gradients carried into it are already weighted: server/rounds/late_rounds.py)."""
    contributors = contributors_of(result) if len(result) >= HEADER_SIZE else 0
    return 1.0 / (contributors * config.local_world_size if contributors else config.world_size)


def abandoned_result(average: torch.Tensor) -> bool:
    """Whether a decoded average is a non-finite block's (NaN in every element; an average of
    finite pushes is finite everywhere, the shard refuses NaN/Inf in a float body). Where
    NaN/Inf gradients fail the encode (no ``allow_non_finite``) no rank pushes one, save a
    rank abandoning its step (``work(..., abandon=True)``): that is what it means there.
    One element read: a whole-block check would cost a pass over every gradient."""
    return average.numel() > 0 and bool(torch.isnan(average.view(-1)[0]))


def abandoned_step_counts(allow_non_finite: bool) -> bool:
    """Whether a step a rank abandoned counts as a finished step on every rank (the step counter
    that ends warm-up, the tuner's step: adaptive broadcasts, auto mode's decisions). The other
    ranks decide it from the marker: with ``allow_non_finite`` their step ends with a non-finite
    average that their GradScaler skips, as after an overflow (counted); without, it raises
    StepAbandoned (not counted). The abandoning rank must count it where they do, or their
    counters part for good: warm-up ends a step apart (the shard refuses a round pushed with two
    codecs) and the tuner's collectives pair across steps."""
    return allow_non_finite


class BlockExchange:
    """The per-block work of one process's pipeline; its coroutines run on the engine's loop and
    their codec work on its codec threads (the kernels release the GIL)."""

    def __init__(self, engine: CommEngine | EngineShare, reducer: NodeReducer | None, config: WorkerConfig,
                 span: CommSpan, allow_non_finite: bool, streams: CodecStreams = CODEC_STREAMS) -> None:
        self._engine, self._reducer, self._config, self._span = engine, reducer, config, span
        self._streams = streams  # a CUDA block's codec calls run on their codec thread's stream
        # a gradient with NaN/Inf travels as a non-finite block (every rank decodes NaN) instead of
        # failing the step: for loss scalers (mixed precision), which then skip it on every rank
        self.allow_non_finite = allow_non_finite

    def work(self, block: BlockState, round_: int, seq: int, ready: torch.cuda.Event | None,
             compressed: bool, abandon: bool = False) -> Coroutine[None, None, int]:
        """The block's exchange for this round, to hand to the engine: the owner's (``exchange``)
        or, on another local rank, a copy of the owner's result (``fetch``). ``ready``: the
        gradient's copies on a CUDA stream, to wait for before reading it. ``abandon``: push a
        non-finite block instead of the gradient, the marker of a step this rank abandoned
        (one rank per node: ``BlockPipeline.abandon_step``)."""
        reducer = self._reducer
        if reducer is not None and reducer.owner(block.spec.block_id) != self._config.local_rank:
            return self.fetch(block, seq, ready)
        return self.exchange(block, round_, seq, ready, compressed, abandon)

    async def exchange(self, block: BlockState, round_: int, seq: int, ready: torch.cuda.Event | None,
                       compressed: bool, abandon: bool = False) -> int:
        """Owner of the block for this node: (local sum,) encode, push, pull, decode, publish.
        ``round_`` numbers the job's rounds (wire and seed), ``seq`` this session's (local ranks).
        Returns the bytes pushed."""
        engine, reducer, spec = self._engine, self._reducer, block.spec
        seed = block_seed(self._config.node_rank, spec.block_id, round_)
        in_thread = self._codec_calls(block.work.device, ready)
        if reducer is not None:
            with timeline.span("reduce", round_, timeline.block_track(spec.block_id), block=spec.block_id):
                await reducer.reduce(spec.block_id, seq, in_thread)
        payload, refused = await in_thread(timeline.wrapped(self._encode, "encode", round_, block=spec.block_id),
                                           block, compressed, seed, round_, abandon)
        # Encoded: let go of the gradient's memory where it is not where the average goes (the DDP
        # hook's early hand-over encodes autograd's own tensor): it is freed now, not a step later.
        block.work = block.buffer
        self._span.note(first=time.perf_counter())  # first byte out
        try:
            result = await engine.push_pull(spec.shard, spec.block_id, round_, payload)
        except CgxPsError as error:  # the shard's error ends the job: the node's other ranks raise it too
            if reducer is None:
                raise
            raise reducer.first_error(error) from None
        abandoned = await in_thread(timeline.wrapped(self.decode, "decode", round_, block=spec.block_id), block,
                                    result)
        self._span.note(last=time.perf_counter())  # last result in
        if reducer is not None:
            reducer.publish(spec.block_id, seq)
        if refused is not None:  # this rank's own error, once its marker's round is done (pushed once)
            raise refused
        if abandoned:  # raised once the node's other ranks have the result: each of them hears it too
            raise self._abandoned(block, round_)
        return len(payload)

    async def fetch(self, block: BlockState, seq: int, ready: torch.cuda.Event | None = None) -> int:
        """Another local rank owns the block: copy its result (our own stream to the block's
        shard hears of a failed round too: stop waiting then). Pushed nothing: returns 0."""
        shard = block.spec.shard
        await self._reducer.fetch(block.spec.block_id, seq, failed=lambda: self._engine.shard_error(shard),
                                  run_in_thread=self._codec_calls(block.buffer.device, ready))
        # (one element read here; on a GPU that waits for the copy above, one small read per block)
        non_finite = abandoned_result(block.buffer)
        if not self.allow_non_finite and non_finite:
            raise self._abandoned(block, None)
        block.result_non_finite = non_finite
        return 0

    @staticmethod
    def _abandoned(block: BlockState, round_: int | None) -> StepAbandoned:
        where = f"block {block.spec.block_id}" + ("" if round_ is None else f" round {round_}")
        return StepAbandoned(f"{where} came back as the non-finite marker of an abandoned step")

    def _codec_calls(self, device: torch.device, ready: torch.cuda.Event | None):
        """``engine.in_thread`` for one block's codec calls: on a CUDA device each runs on its
        codec thread's stream, after ``ready`` (the training thread's writes to the block), so no
        host waits for backward; a CPU block's calls are the engine's as they are."""
        if device.type != "cuda":
            return self._engine.in_thread

        async def in_thread(fn, *args):
            return await self._engine.in_thread(self._streams.wrap(fn, device, ready), *args)

        return in_thread

    def _encode(self, block: BlockState, compressed: bool, seed: int, round_: int,
                abandon: bool = False) -> tuple[PushFrames, CodecError | None]:  # on a codec thread
        """The block's push, and the codec's refusal of this rank's gradient (NaN/Inf without
        ``allow_non_finite``) where there was one: then the push is the abandon marker, so that
        the other ranks' step ends at once with ``StepAbandoned`` instead of waiting for this
        block until the shards' round timeout; the refusal is raised once its round is done."""
        s = block.settings
        codec = codec_of(s) if compressed else Codec.FP32
        refused = None
        if not abandon:
            try:
                encoded = encode_block(block.work, codec, bits=s.bits or 4, bucket_size=s.bucket_size or 1024,
                                       stochastic=s.stochastic, seed=seed, feedback=block.feedback,
                                       allow_non_finite=self.allow_non_finite, scratch=block.scratch)
            except CodecError as exc:
                refused = exc
            else:
                block.non_finite = encoded.header.non_finite
        if abandon or refused is not None:  # the header alone; the residual stays as it was
            encoded = non_finite_block(codec, s.bits or 4, s.bucket_size or 1024, block.spec.numel)
        # framed here, from the reused encode buffer: the payload's one copy (kept until its result
        # comes: the buffer is encoded into again next round), and none on the communication thread
        return PushFrames.of(self._engine.wire_block(block.spec.block_id), round_, encoded.stamped()), refused

    def decode(self, block: BlockState, result: bytes) -> bool:  # on a codec thread
        """Decode the average into ``block.result``; whether it is an abandoned step's
        (``abandoned_result``, where that is what a non-finite result means)."""
        # the average: the division is fused into the CPU decode's pass
        dequantize(result, out=block.result, scale=average_scale(result, self._config))
        if block.result.is_cuda:  # this codec thread's stream only: backward's kernels go on
            torch.cuda.current_stream(block.result.device).synchronize()
        non_finite = abandoned_result(block.result)
        block.result_non_finite = non_finite and self.allow_non_finite
        return not self.allow_non_finite and non_finite
