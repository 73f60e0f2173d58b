"""Fewer bytes touched per step on the worker: blocks encoded from and decoded into the front
end's own gradient memory, payload buffers reused across steps, codec threads sized for the host.

The end-to-end proofs are in test_worker.py (the optimizer against the reference codec, exact)
and test_ddp_hook.py (the hook, also with ``gradient_as_bucket_view``, bit for bit against the
optimizer); this file pins the decisions and the pipeline's memory behaviour, on a real
communication thread with a shard that echoes the push."""

from __future__ import annotations

import pytest
import torch

from cgx_ps.kernels import Codec, CodecError, PayloadScratch, encode
from cgx_ps.worker import WorkerConfig
from cgx_ps.worker.pipeline.buffers import adjacent_span, work_in_place
from cgx_ps.worker.shards.engine import CommEngine
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
from cgx_ps.worker.pipeline.block_pipeline import BlockPipeline
from cgx_ps.worker.pipeline.codec_threads import local_shards, plan_threads

# "big" spans several blocks (each a slice of it: in place); the small ones share a block (copied)
SHAPES = {"big.weight": (96, 100), "small.bias": (30,), "small.weight": (10, 30)}


class EchoEngine(CommEngine):
    """One node alone: the aggregate of a round is its own push; keeps every payload."""

    def __init__(self) -> None:
        super().__init__(WorkerConfig(servers=("127.0.0.1:9",)), "node-0", 1)
        self.payloads: dict[tuple[int, int], bytes] = {}

    async def push_pull(self, shard: int, block_id: int, round_: int, payload: bytes) -> bytes:
        self.payloads[(block_id, round_)] = bytes(payload)  # the worker's push comes framed (PushFrames)
        return self.payloads[(block_id, round_)]


def _pipeline(engine: CommEngine) -> BlockPipeline:
    layout = build_layout([TensorInfo(n, s) for n, s in SHAPES.items()], 2, Compression(bits=3), block_bytes=8192)
    return BlockPipeline(layout, engine, engine.config, {n: torch.device("cpu") for n in SHAPES}, warmup_steps=1,
                         error_feedback=True)


def _step(pipe: BlockPipeline, grads: dict[str, torch.Tensor], in_place: bool) -> int:
    """One optimizer-style step: everything final at once, the averages written into ``grads``."""
    for b in pipe.tensors_ready(list(grads)):
        pipe.submit(b, grads.get, in_place)
    in_place_blocks = pipe.finish_step().in_place_blocks
    for b in range(pipe.num_blocks):
        pipe.copy_out(b, grads.get)
    return in_place_blocks


def test_in_place_blocks_are_bit_identical_to_the_copy_path_and_reuse_their_buffers():
    engines = EchoEngine(), EchoEngine()
    try:
        in_place, copied = _pipeline(engines[0]), _pipeline(engines[1])
        layout = in_place.layout
        whole = [b.block_id for b in layout.blocks if {s.tensor_index for s in b.segments} == {0}]
        assert len(whole) >= 3 and len(whole) < len(layout.blocks)  # the small tensors share a block
        payloads = {}
        for step in range(3):  # warm-up (fp32), then 3-bit with error feedback
            g = torch.Generator().manual_seed(step)
            grads = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
            mine, theirs = {n: t.clone() for n, t in grads.items()}, {n: t.clone() for n, t in grads.items()}
            memory = {n: t.data_ptr() for n, t in mine.items()}
            assert _step(in_place, mine, True) == len(whole)
            assert _step(copied, theirs, False) == 0
            for name in SHAPES:
                assert torch.equal(mine[name], theirs[name]), (step, name)  # the same average, bit for bit
                assert mine[name].data_ptr() == memory[name]  # decoded where the gradient was
            for b in whole:  # the in-place blocks never touched the block buffers
                assert not in_place.buffers[b].any() and copied.buffers[b].any()
            # nor do they keep this step's gradients alive after it (zero_grad(set_to_none=True))
            held = {t.untyped_storage().data_ptr() for block in in_place._blocks
                    for t in (block.work, block.result) if t is not None}
            assert not held & {t.untyped_storage().data_ptr() for t in mine.values()}, step
            if step >= 1:  # compressed steps: each block's payload memory is reused, not allocated afresh
                payloads[step] = [in_place._blocks[b].scratch._payload for b in range(in_place.num_blocks)]
        assert all(a is b and a is not None for a, b in zip(payloads[1], payloads[2], strict=True))
        # and the same bytes went to the shard: reuse changes no payload, crc included
        assert engines[0].payloads == engines[1].payloads and len(engines[0].payloads) == 3 * len(layout.blocks)
    finally:
        for engine in engines:
            engine.close()


def test_payload_scratch_gives_the_bytes_of_a_fresh_encode():
    """A reused buffer holds the last payload's bytes (or a failed encode's half-written ones): the
    next encode with the same settings must still give exactly a fresh encode's bytes."""
    scratch = PayloadScratch()
    gen = torch.Generator().manual_seed(1)
    x = [torch.randn(5000, generator=gen) * (1 + i) for i in range(4)]
    nan = x[0].clone()
    nan[4000] = float("nan")  # found after most buckets are packed
    runs = [(4, False, x[0]), (4, False, x[1]), (4, True, x[1]), (4, True, x[2]), (3, False, x[2]),
            (3, False, nan), (3, False, x[3]), (3, False, x[0])]
    previous = None
    for bits, stochastic, values in runs:
        before = scratch._payload
        if values is nan:
            with pytest.raises(CodecError):
                encode(values, Codec.MAXMIN, bits=bits, stochastic=stochastic, seed=7, scratch=scratch)
            assert scratch._payload is before  # the failed encode wrote into the reused buffer
            continue
        fresh = encode(values, Codec.MAXMIN, bits=bits, stochastic=stochastic, seed=7).to_bytes()
        reused = encode(values, Codec.MAXMIN, bits=bits, stochastic=stochastic, seed=7, scratch=scratch)
        assert reused.to_bytes() == fresh, (bits, stochastic)
        assert reused.payload is scratch._payload
        assert (before is scratch._payload) is (previous == (bits, stochastic))  # reused only for the same settings
        previous = (bits, stochastic)


def test_in_place_decisions_and_spans():
    assert work_in_place(intranode=False, tuned=False).allowed
    assert "intra-node" in work_in_place(intranode=True, tuned=False).reason
    assert "tuner" in work_in_place(intranode=False, tuned=True).reason
    bucket = torch.zeros(100)
    a, b = bucket[:40].view(4, 10), bucket[40:70]
    span = adjacent_span([a.view(-1), b])
    assert span is not None and span.data_ptr() == bucket.data_ptr() and span.numel() == 70
    assert adjacent_span([b, a.view(-1)]) is None  # not in the block's order
    assert adjacent_span([bucket[:40], bucket[41:70]]) is None  # a gap
    assert adjacent_span([bucket[:40], None]) is None  # no gradient: zeros are filled in
    assert adjacent_span([bucket.half()[:10]]) is None  # upcast: copied
    assert adjacent_span([torch.zeros(10, 10).t()]) is None  # not contiguous
    assert adjacent_span([bucket[:40], torch.zeros(30)]) is None  # another tensor


@pytest.mark.parametrize("cpus, torch_threads, ranks, shards, override, want", [
    (2, 1, 1, 1, 0, (1, 1)),  # this CI machine with a colocated shard: one codec thread
    (2, 1, 1, 0, 0, (1, 1)),
    (16, 4, 1, 1, 0, (2, 5)),  # 11 spare: two blocks at once, 5 threads each
    (16, 2, 4, 2, 0, (1, 1)),  # 4 local ranks share the 6 spare cores: one each
    (4, 8, 1, 0, 0, (1, 1)),  # oversubscribed by torch already: still one
    (2, 1, 1, 1, 6, (2, 3)),  # CGX_PS_CODEC_THREADS=6
])
def test_codec_threads_are_sized_for_the_host(cpus, torch_threads, ranks, shards, override, want):
    plan = plan_threads(cpus, torch_threads, ranks, shards, override)
    assert (plan.codec_workers, plan.kernel_threads) == want
    assert plan.reason


def test_local_shards_are_those_this_host_can_bind():
    # 192.0.2.0/24 is TEST-NET-1: never an address of this host
    assert local_shards(["127.0.0.1:7070", "localhost:7071", "192.0.2.1:7070", "no-such-host.invalid:1"]) == 2
