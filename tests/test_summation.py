"""EncodedSum (kernels/summation.py), the shard's fused sum of a round's pushes, must write exactly
the bytes of the accumulator path it replaced: decode each push into a float32 accumulator in
arrival order (the first overwrites), then encode the sum once, with error feedback over rounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgx_ps.kernels import Codec, CodecError, EncodedSum, ErrorFeedback, PayloadScratch, dequantize, encode, encode_block


def accumulator_path(payloads: list[bytes], numel: int, codec: Codec, bits: int, bucket: int, stochastic: bool,
                     seed: int, feedback: ErrorFeedback | None, allow_non_finite: bool = False,
                     numpy: bool = False) -> bytes:
    """What the shard did before EncodedSum (aggregator.py up to a3d4b79), in a torch tensor as a
    worker would, or (``numpy``) in a numpy array as a shard, which never imports torch, does."""
    acc = np.empty(numel, dtype=np.float32) if numpy else torch.empty(numel, dtype=torch.float32)
    for i, payload in enumerate(payloads):
        dequantize(payload, out=acc, accumulate=i > 0)
    return encode_block(acc, codec, bits=bits, bucket_size=bucket, stochastic=stochastic, seed=seed,
                        feedback=feedback, allow_non_finite=allow_non_finite).to_bytes()


def pushes(gen: torch.Generator, n: int, numel: int, codec: Codec, bits: int, bucket: int, round_: int) -> list[bytes]:
    # different scales per node, so bucket ranges differ and the additions really round
    return [encode(torch.randn(numel, generator=gen) * (1 + 3 * i), codec, bits=bits, bucket_size=bucket,
                   stochastic=True, seed=100 * round_ + i).to_bytes() for i in range(n)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(numel=st.integers(1, 3000), bits=st.integers(1, 8), bucket=st.sampled_from([8, 16, 24, 64, 512]),
       nodes=st.integers(1, 6), stochastic=st.booleans(), feedback=st.booleans(),
       keep=st.sampled_from([None, 0, 1, 2]), seed=st.integers(0, 2**62), threads=st.sampled_from([None, 1, 3]))
def test_fused_sum_writes_the_accumulator_paths_bytes(numel: int, bits: int, bucket: int, nodes: int,
                                                       stochastic: bool, feedback: bool, keep: int | None,
                                                       seed: int, threads: int | None) -> None:
    """Every width, bucket size (partial last buckets included), node count, rounding mode, with and
    without server-side error feedback over three rounds, and with fewer slots than pushes forcing
    folds into the accumulator (keep: slots; 0 = none, the accumulator path itself).
    Above 128 buckets a call is split across threads (cpu._run_split): as many as the kernels'
    default, one (a shard whose executor runs a thread per core, server/rounds/kernel_threads.py), or three."""
    gen = torch.Generator().manual_seed(seed % 2**31)
    total = EncodedSum(numel, parts=max(1, nodes if keep is None else keep), keep_bytes=0 if keep == 0 else None,
                       threads=threads)
    want_fb, got_fb, np_fb = (ErrorFeedback(), ErrorFeedback(), ErrorFeedback()) if feedback else (None, None, None)
    scratch = PayloadScratch()  # encoded into round after round, as a shard's block does
    for round_ in range(3):
        payloads = pushes(gen, nodes, numel, Codec.MAXMIN, bits, bucket, round_)
        want = accumulator_path(payloads, numel, Codec.MAXMIN, bits, bucket, stochastic, seed + round_, want_fb)
        # numpy's float32 arithmetic (a shard's) writes torch's bytes
        assert accumulator_path(payloads, numel, Codec.MAXMIN, bits, bucket, stochastic, seed + round_, np_fb,
                                numpy=True) == want
        for payload in payloads:
            total.add(payload)
        got = total.encode(Codec.MAXMIN, bits=bits, bucket_size=bucket, stochastic=stochastic, seed=seed + round_,
                           feedback=got_fb, scratch=scratch).to_bytes()
        total.clear()
        assert got == want
        if feedback:
            assert np.asarray(got_fb.residual).tobytes() == want_fb.residual.numpy().tobytes()
            assert np_fb.residual.tobytes() == want_fb.residual.numpy().tobytes()


@pytest.mark.parametrize("codec", [Codec.FP32, Codec.FP16, Codec.BF16])
def test_float_codecs_and_a_change_of_encoding_between_sums(codec: Codec) -> None:
    """Float pushes are summed as they come; the same EncodedSum then sums 4-bit pushes (an
    adaptive-compression change) with the right bytes."""
    gen = torch.Generator().manual_seed(int(codec))
    numel = 1000
    total = EncodedSum(numel, parts=3)
    payloads = pushes(gen, 3, numel, codec, 32, 0, 0)
    for payload in payloads:
        total.add(payload)
    assert total.encode(codec, bits=32, bucket_size=0, stochastic=False, seed=1).to_bytes() == \
        accumulator_path(payloads, numel, codec, 32, 0, False, 1, None)
    total.clear()
    payloads = pushes(gen, 3, numel, Codec.MAXMIN, 4, 64, 1)
    for payload in payloads:
        total.add(payload)
    assert total.encode(Codec.MAXMIN, bits=4, bucket_size=64, stochastic=True, seed=2).to_bytes() == \
        accumulator_path(payloads, numel, Codec.MAXMIN, 4, 64, True, 2, None)


def test_bad_push_changes_nothing_and_non_finite_or_overflowing_sums() -> None:
    numel = 512
    gen = torch.Generator().manual_seed(3)
    total = EncodedSum(numel, parts=2)
    good = pushes(gen, 2, numel, Codec.MAXMIN, 4, 64, 0)
    corrupt = bytearray(good[1])
    corrupt[-1] ^= 0xFF
    total.add(good[0])
    with pytest.raises(CodecError, match="crc32"):
        total.add(bytes(corrupt))
    with pytest.raises(CodecError, match="elements"):
        total.add(pushes(gen, 1, numel + 8, Codec.MAXMIN, 4, 64, 0)[0])
    total.add(good[1])
    assert total.count == 2
    assert total.encode(Codec.MAXMIN, bits=4, bucket_size=64, stochastic=False, seed=0).to_bytes() == \
        accumulator_path(good, numel, Codec.MAXMIN, 4, 64, False, 0, None)
    total.clear()
    # a non-finite push (mixed precision's overflow) makes the sum a non-finite block
    inf = torch.randn(numel)
    inf[5] = float("inf")
    flagged = encode(inf, Codec.MAXMIN, bits=4, bucket_size=64, allow_non_finite=True).to_bytes()
    for payload in (good[0], flagged):
        total.add(payload)
    assert total.encode(Codec.MAXMIN, bits=4, bucket_size=64, stochastic=False, seed=0,
                        allow_non_finite=True).to_bytes() == \
        accumulator_path([good[0], flagged], numel, Codec.MAXMIN, 4, 64, False, 0, None, allow_non_finite=True)
    total.clear()
    # finite pushes whose sum's range overflows float32: refused, as encoding the accumulator is
    huge = [encode(torch.full((numel,), s * 3e38).index_fill_(0, torch.tensor([0]), 0.0), Codec.MAXMIN, bits=4,
                   bucket_size=64).to_bytes() for s in (1.0, 1.0)]
    for payload in huge:
        total.add(payload)
    with pytest.raises(CodecError):
        accumulator_path(huge, numel, Codec.MAXMIN, 4, 64, False, 0, None)
    with pytest.raises(CodecError, match="NaN/Inf|overflows"):
        total.encode(Codec.MAXMIN, bits=4, bucket_size=64, stochastic=False, seed=0)


def test_a_sum_holds_its_kept_pushes_or_its_accumulator_not_both() -> None:
    """A shard is sized for one fp32 accumulator per block (server/process/sizing.py): the kept pushes that
    replace it must not come on top of it. Immutable payloads are kept where they are (their
    levels are not copied), a mutable one is copied, and clearing the sum lets them go."""
    numel, gen = 4096, torch.Generator().manual_seed(5)
    acc_bytes = 4 * numel
    total = EncodedSum(numel, parts=3)
    for round_, (codec, bits, bucket) in enumerate([(Codec.FP32, 32, 0), (Codec.MAXMIN, 4, 64),
                                                    (Codec.MAXMIN, 4, 64), (Codec.FP16, 16, 0)]):
        payloads = pushes(gen, 3, numel, codec, bits, bucket, round_)
        kept = [payloads[0], bytearray(payloads[1]), memoryview(b"\0" + payloads[2])[1:]]  # any alignment
        for payload in kept:
            total.add(payload)
            assert total.held_bytes <= acc_bytes + (8 * 3 * numel // bucket if bucket else 0)
        if codec == Codec.MAXMIN:
            kept[1][-1] ^= 0xFF  # changed after it was checked: the sum has its own copy
            assert total._levels[0].base is not None and total._levels[1].base is None
        got = total.encode(codec, bits=bits, bucket_size=bucket, stochastic=True, seed=round_).to_bytes()
        assert got == accumulator_path(payloads, numel, codec, bits, bucket, True, round_, None)
        total.clear()
        metadata_rows = 3 * 8 * (numel // bucket) if bucket else 0
        assert total.held_bytes == (acc_bytes if codec != Codec.MAXMIN else metadata_rows), (round_, total.held_bytes)
    # 16 nodes at 4 bits do not fit in one accumulator's size: they sum through the accumulator
    many = EncodedSum(numel, parts=16)
    payloads = pushes(gen, 16, numel, Codec.MAXMIN, 4, 64, 9)
    for payload in payloads:
        many.add(payload)
        assert many.held_bytes <= acc_bytes
    assert many.encode(Codec.MAXMIN, bits=4, bucket_size=64, stochastic=True, seed=9).to_bytes() == \
        accumulator_path(payloads, numel, Codec.MAXMIN, 4, 64, True, 9, None)


@pytest.mark.parametrize("codec,bits,bucket", [(Codec.MAXMIN, 4, 64), (Codec.FP32, 32, 0)])
def test_scaled_additions_join_the_kept_pushes_and_a_bad_one_changes_nothing(codec: Codec, bits: int,
                                                                              bucket: int) -> None:
    """A shard's late-push corrections (server/rounds/late_rounds.py): ``add_scaled`` of payloads
    with any weights, before or after kept pushes, sums what an accumulator of fp32 values would
    (to the float rounding of the weights); a bad payload raises and changes nothing."""
    numel, gen = 3000, torch.Generator().manual_seed(11)
    kept = pushes(gen, 3, numel, codec, bits, bucket, 1)
    late = pushes(gen, 2, numel, Codec.MAXMIN, 3, 64, 2)  # a late push may be in its own round's bits
    total = EncodedSum(numel, parts=3)
    total.add_scaled(late[0], 0.75)
    for payload in kept:
        total.add(payload)
    with pytest.raises(CodecError):
        total.add_scaled(late[1][:-1], 2.0)
    total.add_scaled(late[1], -0.25)
    assert total.count == 5
    expected = sum(dequantize(p) for p in kept) + 0.75 * dequantize(late[0]) - 0.25 * dequantize(late[1])
    got = dequantize(total.encode(Codec.FP32, bits=32, bucket_size=0, stochastic=False, seed=0).to_bytes())
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, sum(dequantize(p) for p in kept), atol=1e-3)
