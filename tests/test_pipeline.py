"""The block pipeline on its own: a real communication thread, a shard that echoes the push.

Drives it the way a DDP communication hook will (buckets of several tensors, a future per
bucket) and the way the optimizer does (one tensor at a time, the rest at the end)."""

from __future__ import annotations

import gc
import weakref
import zlib

import numpy as np

import pytest
import torch

from cgx_ps.kernels import Codec, dequantize, encode
from cgx_ps.model_layout import codec_of
from cgx_ps.worker import CgxPsError, WorkerConfig
from cgx_ps.worker.tuning.tuner import Tunable
from cgx_ps.worker.shards.engine import CommEngine
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
from cgx_ps.worker.pipeline.block_pipeline import BlockPipeline

SHAPES = {"a.weight": (64, 100), "a.bias": (64,), "b.weight": (10, 64), "c.weight": (50, 50)}


class EchoEngine(CommEngine):
    """One node alone: the aggregate of a round is its own push (the shard's re-encoding aside)."""

    def __init__(self) -> None:
        super().__init__(WorkerConfig(servers=("127.0.0.1:9",)), "node-0", 1)
        self.pushed: list[tuple[int, int, int]] = []  # (shard, block, round)

    async def push_pull(self, shard: int, block_id: int, round_: int, payload: bytes) -> bytes:
        self.pushed.append((shard, block_id, round_))
        return bytes(payload)  # the worker's push comes framed (PushFrames)


@pytest.fixture
def engine():
    engine = EchoEngine()
    yield engine
    engine.close()


@pytest.fixture
def pipe(engine):
    layout = build_layout([TensorInfo(n, s) for n, s in SHAPES.items()], 2, Compression(bits=3), block_bytes=8192)
    return BlockPipeline(layout, engine, engine.config, {n: torch.device("cpu") for n in SHAPES}, warmup_steps=1)


def _grads(step: int) -> dict[str, torch.Tensor]:
    return {n: torch.randn(s, generator=torch.Generator().manual_seed(step * 10 + i)) for i, (n, s) in
            enumerate(SHAPES.items())}


def _expected(pipe: BlockPipeline, grads: dict[str, torch.Tensor], step: int, compressed: bool) -> dict:
    """What every tensor must hold after the step: each block encoded with its seed, decoded."""
    out = {n: torch.empty(s) for n, s in SHAPES.items()}
    for b in pipe.layout.blocks:
        x = torch.cat([grads[pipe.layout.tensors[s.tensor_index].name].reshape(-1)[s.offset:s.offset + s.numel]
                       for s in b.segments])
        codec = codec_of(b.codec) if compressed else Codec.FP32
        seed = zlib.crc32(f"0/{b.block_id}/{step}".encode())
        y = dequantize(encode(x, codec, bits=b.codec.bits or 4, bucket_size=b.codec.bucket_size or 1024,
                              stochastic=b.codec.stochastic, seed=seed).to_bytes())
        at = 0
        for s in b.segments:
            out[pipe.layout.tensors[s.tensor_index].name].view(-1)[s.offset:s.offset + s.numel] = y[at:at + s.numel]
            at += s.numel
    return out


def test_buckets_of_tensors_drive_it_like_a_ddp_hook(pipe, engine):
    buckets = [["c.weight", "b.weight"], ["a.bias", "a.weight"]]  # DDP's order: last layers first
    previous_step_end = 0.0
    for step in range(2):  # warm-up (uncompressed), then compressed
        grads, results, futures = _grads(step), {n: torch.zeros(s) for n, s in SHAPES.items()}, []
        for names in buckets:
            for b in pipe.tensors_ready(names):
                pipe.submit(b, grads.get)
            blocks = pipe.blocks_of(names)

            def back(done, blocks=blocks, names=names):
                done.wait()
                for b in blocks:
                    pipe.copy_out(b, lambda n: results[n] if n in names else None)  # noqa: B023 - called here
                return names

            futures.append(torch.futures.collect_all([pipe.future(b) for b in blocks]).then(back))
        assert [f.wait() for f in futures] == buckets
        assert pipe.take_unsubmitted() == []
        stats = pipe.finish_step(backward_s=0.5)
        assert (stats.step, stats.compressed, stats.backward_s) == (step, step >= 1, 0.5)
        assert stats.fp32_bytes == 4 * sum(b.numel for b in pipe.layout.blocks)
        assert (stats.ratio > 5) is (step >= 1)
        # when each tensor arrived, this step's only (backward's order for auto mode's model)
        arrived = stats.arrivals
        assert set(arrived) == set(SHAPES) and min(arrived.values()) > previous_step_end
        assert max(arrived[n] for n in buckets[0]) < min(arrived[n] for n in buckets[1])
        previous_step_end = max(arrived.values())
        for name, want in _expected(pipe, grads, step, compressed=step >= 1).items():
            assert torch.equal(results[name], want), (step, name)
            assert torch.equal(pipe.gradient(name), want.view(-1))  # the buffers, without a copy
    assert sorted(r for _, _, r in engine.pushed) == [0] * pipe.num_blocks + [1] * pipe.num_blocks


def test_an_average_goes_where_out_of_says_and_the_source_is_let_go_once_encoded(pipe):
    """The DDP hook's early hand-over: encoded from autograd's tensor, decoded into DDP's bucket;
    autograd's tensor must not be written, nor kept alive past its encoding."""
    arrays = {n: np.random.default_rng(i).standard_normal(s).astype(np.float32) for i, (n, s) in enumerate(SHAPES.items())}
    alive = [weakref.ref(a) for a in arrays.values()]  # a tensor from numpy keeps its array alive
    sources = {n: torch.from_numpy(a) for n, a in arrays.items()}
    want = {n: t.clone() for n, t in sources.items()}
    targets = {n: torch.zeros(s) for n, s in SHAPES.items()}
    del arrays
    for b in pipe.tensors_ready(list(SHAPES)):
        pipe.submit(b, sources.get, True, out_of=targets.get)
    stats = pipe.finish_step()  # warm-up step: fp32, so the average of one node is its gradient
    for b in range(pipe.num_blocks):
        pipe.copy_out(b, targets.get)  # blocks not in place come from the block buffers
    assert 0 < stats.in_place_blocks < pipe.num_blocks
    for name in SHAPES:
        assert torch.equal(targets[name], want[name]) and torch.equal(sources[name], want[name]), name
    del sources
    gc.collect()
    assert [ref() for ref in alive] == [None] * len(alive)


def test_it_is_what_the_tuner_reads(pipe):
    assert isinstance(pipe, Tunable)
    assert (pipe.next_round, pipe.compress, pipe.rank) == (0, True, 0)
    quantized = [b.block_id for b in pipe.layout.blocks if b.codec.bits]
    changed = {b: type(pipe.settings(b))(codec=pipe.settings(b).codec, bits=2, bucket_size=8) for b in quantized}
    pipe.apply(False, changed)
    assert not pipe.compress and all(pipe.settings(b).bits == 2 for b in quantized)


def test_blocks_without_gradients_are_sent_as_zeros_and_bad_gradients_are_named(pipe):
    grads = _grads(0)
    grads["c.weight"][49, 49] = float("nan")  # in the block holding c.weight alone
    for b in pipe.tensors_ready(["c.weight"]):
        pipe.submit(b, grads.get)
    with pytest.raises(CgxPsError, match="before every block was submitted"):
        pipe.finish_step()
    for b in pipe.tensors_ready(["c.weight"]):  # the step starts over
        pipe.submit(b, grads.get)
    for b in pipe.take_unsubmitted():
        pipe.submit(b, {}.get)  # a.*, b.*: no gradient this step
    with pytest.raises(CgxPsError, match=r"rank 0: cannot encode the gradient of c.weight: .*NaN/Inf"):
        pipe.finish_step()
    grads = _grads(1)
    for b in pipe.take_unsubmitted():
        pipe.submit(b, lambda n: grads[n] if n.startswith("a.") else None)
    pipe.finish_step()
    assert torch.equal(pipe.gradient("a.weight"), grads["a.weight"].view(-1))  # warm-up: fp32, exact
    assert not pipe.gradient("b.weight").any()


def test_non_finite_gradients_travel_as_nan_when_allowed(engine):
    """allow_non_finite (mixed precision): the block holding an Inf decodes as NaN, the others
    as usual; the step does not fail."""
    layout = build_layout([TensorInfo(n, s) for n, s in SHAPES.items()], 2, Compression(bits=3), block_bytes=8192)
    pipe = BlockPipeline(layout, engine, engine.config, {n: torch.device("cpu") for n in SHAPES},
                         allow_non_finite=True)
    grads = _grads(0)
    grads["c.weight"][3, 4] = float("inf")  # in the first of c.weight's blocks
    for b in pipe.take_unsubmitted():
        pipe.submit(b, grads.get)
    pipe.finish_step()
    first = pipe.blocks_of(["c.weight"])[0]
    assert bool(pipe.buffers[first].isnan().all())
    assert all(bool(pipe.buffers[b].isfinite().all()) for b in range(pipe.num_blocks) if b != first)


class KeepingEngine(EchoEngine):
    """Keeps every push as the shard client does for a re-push after a repair (until its
    result comes, which may be after the block's next encode), with its frames' bytes then."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[tuple[tuple[int, int], object, bytes]] = []

    async def push_pull(self, shard: int, block_id: int, round_: int, payload) -> bytes:
        self.kept.append(((block_id, round_), payload, b"".join(bytes(f) for f in payload.frames)))
        return await super().push_pull(shard, block_id, round_, payload)


def test_frames_kept_for_a_re_push_are_not_changed_by_the_blocks_next_encode():
    """A push is framed on the codec thread from the block's reused encode buffer
    (PayloadScratch); the client keeps those frames until the round's result, to push them
    again after a repair. The next round's encode of the block (same settings: the same buffer)
    must not change them: a re-push would carry the next round's bytes under the old round.
    Warm-up (fp32), compressed, compressed again, uncompressed (auto mode's other path)."""
    engine = KeepingEngine()
    try:
        layout = build_layout([TensorInfo(n, s) for n, s in SHAPES.items()], 2, Compression(bits=3),
                              block_bytes=8192)
        pipe = BlockPipeline(layout, engine, engine.config, {n: torch.device("cpu") for n in SHAPES},
                             warmup_steps=1)
        for step in range(4):
            if step == 3:
                pipe.apply(False, {})  # what auto mode's tuner does to send a step uncompressed
            grads = _grads(step)
            for b in pipe.take_unsubmitted():
                pipe.submit(b, grads.get)
            assert pipe.finish_step().compressed is (step in (1, 2))
    finally:
        engine.close()
    by_round = {key: then for key, _, then in engine.kept}
    assert len(by_round) == 4 * pipe.num_blocks
    for (block, round_), payload, then in engine.kept:
        now = b"".join(bytes(f) for f in payload.frames)
        assert now == then, f"block {block} round {round_}: its kept frames changed after its next encode"
        if round_ == 1:  # the same buffer was encoded into again, with other bytes
            assert by_round[(block, 2)] != then
