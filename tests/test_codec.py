"""Codec contract: bounds, unbiasedness, byte-identical implementations, and every bad input."""

from __future__ import annotations

import struct
import threading
import time

import numpy as np
import pytest
import torch

from cgx_ps.kernels import (HEADER_SIZE, Codec, CodecError, ErrorFeedback, check_payload, decode_header, dequantize,
                            encode, encode_block, quantize)
from cgx_ps.kernels import cpu, rng, wire

LENGTHS = [1, 7, 8, 1023, 1024, 1025, 10_007]
BUCKETS = [8, 24, 1024]


def _data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # mixed scales, like real gradients: most small, some large
    return torch.randn(n, generator=g) * torch.logspace(-4, 1, n).roll(n // 3)


def _units(payload: bytes, n: int, bucket_size: int) -> torch.Tensor:
    """Per-element unit read back from the payload's metadata."""
    nb = wire.num_buckets(n, bucket_size)
    meta = np.frombuffer(payload, dtype="<f4", count=2 * nb, offset=HEADER_SIZE).reshape(nb, 2)
    return torch.from_numpy(meta[:, 1].copy()).repeat_interleave(bucket_size)[:n]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("stochastic", [False, True])
def test_round_trip_within_bound(bits: int, stochastic: bool) -> None:
    for n in LENGTHS:
        for bs in BUCKETS:
            x = _data(n, seed=bits)
            payload = quantize(x, bits, bs, stochastic=stochastic, seed=3).to_bytes()
            y = dequantize(payload)
            unit = _units(payload, n, bs)
            slack = 1e-6 * x.abs().max() + 1e-30  # float32 rounding of min + unit * level
            err = (x - y).abs()
            if stochastic:
                assert bool((err < unit + slack).all()), (n, bs)
            else:
                assert bool((err <= unit / 2 + slack).all()), (n, bs)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bucket_size", BUCKETS)
def test_cpu_kernel_byte_identical_to_reference(bits: int, stochastic: bool, bucket_size: int) -> None:
    for n in LENGTHS:
        x = _data(n, seed=n)
        ref = quantize(x, bits, bucket_size, stochastic=stochastic, seed=11, impl="reference")
        fast = quantize(x, bits, bucket_size, stochastic=stochastic, seed=11, impl="cpu")
        assert fast.to_bytes() == ref.to_bytes(), n
        payload = ref.to_bytes()
        assert torch.equal(dequantize(payload, impl="cpu"), dequantize(payload, impl="reference"))


# These widths (un)pack whole 8-level groups in a loop per width, then a bucket's partial last
# group; the sizes leave such partial groups and make many buckets (the threaded split).
ODD_BITS = [1, 3, 5, 6, 7]
ODD_LENGTHS = [1, 7, 9, 1023, 100_003]
ODD_BUCKETS = [8, 16, 104, 1024]  # the format requires multiples of 8 (test_bad_bucket_size)


@pytest.mark.parametrize("bits", ODD_BITS)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bucket_size", ODD_BUCKETS)
def test_odd_widths_byte_identical_and_decode_like_reference(bits: int, stochastic: bool,
                                                             bucket_size: int) -> None:
    for n in ODD_LENGTHS:
        x = _data(n, seed=n + bits)
        ref = quantize(x, bits, bucket_size, stochastic=stochastic, seed=7, impl="reference").to_bytes()
        fast = quantize(x, bits, bucket_size, stochastic=stochastic, seed=7, impl="cpu").to_bytes()
        assert fast == ref, n
        expected = dequantize(ref, impl="reference")
        assert torch.equal(dequantize(ref, impl="cpu"), expected), n
        base = _data(n, seed=n + 100)
        out = base.clone()
        assert dequantize(ref, out=out, accumulate=True, impl="cpu") is out
        assert torch.equal(out, base + expected), n


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_whole_byte_widths_accumulate_like_reference_with_partial_last_bytes(bits: int) -> None:
    # 2/4/8 bits split bytes into a level buffer before the decode pass; odd lengths and buckets
    # leave a bucket's last levels in a partial byte (the tail path)
    for n, bucket_size in ((1, 8), (7, 8), (1023, 104), (100_003, 1024)):
        ref = quantize(_data(n, seed=n + bits), bits, bucket_size, stochastic=True, seed=5,
                       impl="reference").to_bytes()
        base = _data(n, seed=n + 200)
        out = base.clone()
        dequantize(ref, out=out, accumulate=True, impl="cpu")
        assert torch.equal(out, base + dequantize(ref, impl="reference")), n


@pytest.mark.parametrize("bits", ODD_BITS)
def test_odd_widths_every_level_in_every_slot(bits: int) -> None:
    # Integer data spanning 0..2**bits - 1 in each bucket: unit = 1 and min = 0, so the levels are
    # the values themselves and decoding is exact. Drawn at random, every level lands in every
    # position of an 8-level group (and so at every bit offset of its bytes).
    top = (1 << bits) - 1
    g = torch.Generator().manual_seed(bits)
    n = 64 * 8 * (top + 1) + 5
    x = torch.randint(0, top + 1, (n,), generator=g).float()
    x[::64] = 0.0
    x[1::64] = float(top)
    for stochastic in (False, True):
        ref = quantize(x, bits, 64, stochastic=stochastic, seed=1, impl="reference").to_bytes()
        assert quantize(x, bits, 64, stochastic=stochastic, seed=1, impl="cpu").to_bytes() == ref
        assert torch.equal(dequantize(ref, impl="cpu"), x)
    levels = x[: n - 5].view(-1, 8).long()
    slots = torch.stack([torch.bincount(levels[:, k], minlength=top + 1) for k in range(8)])
    assert bool((slots > 0).all())  # the test really covers every (level, slot) pair


def test_multithreaded_split_matches_reference() -> None:
    old = cpu.num_threads()
    cpu.set_num_threads(3)  # several bucket ranges, uneven split
    try:
        x = _data(300_001)
        for stochastic in (False, True):
            ref = quantize(x, 4, 512, stochastic=stochastic, seed=5, impl="reference").to_bytes()
            assert quantize(x, 4, 512, stochastic=stochastic, seed=5).to_bytes() == ref
            out = torch.ones(x.numel())
            dequantize(ref, out=out, accumulate=True)
            assert torch.equal(out, 1 + dequantize(ref, impl="reference"))
    finally:
        cpu.set_num_threads(old)


def test_thread_count_changes_while_other_threads_encode() -> None:
    """Workers set the kernels' split at run time (worker/pipeline/codec_threads.py), while a shard in the same
    process, or another pipeline, may be mid-call: no call may fail or change its bytes."""
    old = cpu.num_threads()
    x = _data(200_003)
    ref = quantize(x, 4, 256, stochastic=True, seed=3).to_bytes()
    errors: list[BaseException] = []
    stop = threading.Event()

    def encode_loop() -> None:
        try:
            while not stop.is_set():
                assert quantize(x, 4, 256, stochastic=True, seed=3).to_bytes() == ref
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=encode_loop) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for k in range(60):
            cpu.set_num_threads(1 + k % 4)
            time.sleep(0.002)
    finally:
        stop.set()
        for t in threads:
            t.join()
        cpu.set_num_threads(old)
    assert not errors, errors[0]


def test_stochastic_rounding_is_unbiased_and_nearest_is_not() -> None:
    x = torch.linspace(-1, 1, 512) + 0.0123  # values that sit between levels
    seeds = 4000
    acc = torch.zeros_like(x)
    for seed in range(seeds):
        dequantize(quantize(x, 2, 512, stochastic=True, seed=seed), out=acc, accumulate=True)
    mean = acc / seeds
    unit = (x.max() - x.min()) / 3
    # one draw has std <= unit / 2; the mean of `seeds` draws, <= unit / (2 sqrt(seeds))
    sigma = unit / (2 * seeds**0.5)
    assert float((mean - x).abs().max()) < 6 * sigma
    nearest_err = (dequantize(quantize(x, 2, 512)) - x).abs().max()
    assert float(nearest_err) > 20 * sigma  # the test could tell a biased rounding apart


def test_seed_reproducible_and_distinct() -> None:
    x = _data(5000)
    a = quantize(x, 3, 1024, stochastic=True, seed=42).to_bytes()
    assert a == quantize(x, 3, 1024, stochastic=True, seed=42).to_bytes()
    assert a != quantize(x, 3, 1024, stochastic=True, seed=43).to_bytes()


def test_uniforms_in_unit_interval_and_hash_of_zero_is_zero() -> None:
    r = rng.uniforms(7, 0, 100_000)
    assert r.dtype == np.float32 and r.min() >= 0 and r.max() < 1
    assert abs(float(r.mean()) - 0.5) < 0.01
    assert int(rng.mix32(np.array([0], dtype=np.uint64))[0]) == 0  # so i_hi = 0 adds nothing


def test_constant_buckets_decode_exactly() -> None:
    x = torch.cat([torch.full((1024,), 0.123), torch.zeros(1024), torch.full((5,), -7.5)])
    for bits in (1, 4, 8):
        for stochastic in (False, True):
            assert torch.equal(dequantize(quantize(x, bits, 1024, stochastic=stochastic)), x)


def test_subnormal_range_encodes_like_a_constant_bucket() -> None:
    x = torch.tensor([0.0, 3.57e-43, 1e-43, 2e-43] * 2)  # unit is subnormal: 1/unit overflows
    for bits in (1, 4, 8):
        ref = quantize(x, bits, 8, impl="reference").to_bytes()
        assert quantize(x, bits, 8, impl="cpu").to_bytes() == ref
        assert bool((dequantize(ref) == 0.0).all())


def test_empty_and_one_element() -> None:
    block = quantize(torch.empty(0))
    payload = block.to_bytes()
    assert len(payload) == HEADER_SIZE and block.numel == 0
    assert dequantize(payload).numel() == 0
    one = torch.tensor([3.25])
    assert torch.equal(dequantize(quantize(one, 4).to_bytes()), one)


def test_sizes_and_header_fields() -> None:
    x = _data(10_000)
    block = quantize(x, 3, 1024, stochastic=True)
    payload = block.to_bytes()
    nb = 10
    assert len(payload) == HEADER_SIZE + 8 * nb + (10_000 * 3 + 7) // 8 == block.nbytes
    h = decode_header(payload)
    assert (h.codec, h.bits, h.bucket_size, h.numel, h.stochastic) == (Codec.MAXMIN, 3, 1024, 10_000, True)
    assert len(encode(x, Codec.FP32).to_bytes()) == HEADER_SIZE + 40_000
    assert len(encode(x, Codec.FP16).to_bytes()) == HEADER_SIZE + 20_000


def test_float_codecs() -> None:
    x = _data(3001)
    assert torch.equal(dequantize(encode(x, Codec.FP32).to_bytes()), x)
    assert torch.equal(dequantize(encode(x, Codec.FP16).to_bytes()), x.half().float())
    assert torch.equal(dequantize(encode(x, Codec.BF16).to_bytes()), x.bfloat16().float())
    # half-precision input is accepted and widened first
    assert torch.equal(dequantize(encode(x.half(), Codec.FP32).to_bytes()), x.half().float())


def test_half_precision_codecs_round_as_torch_does_at_every_edge() -> None:
    """fp16 and bf16 bodies are rounded with numpy (a shard has no torch): the bits of torch's own
    .half() and .bfloat16() for every kind of float32 (random bit patterns: subnormals, ties,
    values just under each format's largest), and numpy input encodes as the tensor does."""
    gen = np.random.default_rng(7)
    bits = gen.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
    ties = (gen.integers(0, 2**16, 50_000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000  # bf16 halfway
    x = np.concatenate([bits, ties]).view(np.float32)
    for codec, limit, to in ((Codec.FP16, 65504.0, torch.float16), (Codec.BF16, 3.38e38, torch.bfloat16)):
        values = torch.from_numpy(x[np.isfinite(x) & (np.abs(x) < limit)].copy())
        want = values.to(to).view(torch.uint8).numpy().tobytes()
        for given in (values, values.numpy()):
            assert encode(given, codec).to_bytes()[HEADER_SIZE:] == want, (codec, type(given))
    y = _data(3001)
    for codec in Codec:
        assert encode(y.numpy(), codec, bits=4, bucket_size=64, stochastic=True, seed=3).to_bytes() == \
            encode(y, codec, bits=4, bucket_size=64, stochastic=True, seed=3).to_bytes()


def test_dequantize_accumulate_and_out_dtypes() -> None:
    x = _data(4000)
    payload = quantize(x, 4, 1024).to_bytes()
    decoded = dequantize(payload)
    out = torch.full((40, 100), 2.0)  # any shape with the right numel
    assert dequantize(payload, out=out, accumulate=True) is out
    assert torch.equal(out.view(-1), 2.0 + decoded)
    half = torch.zeros(4000, dtype=torch.float16)
    dequantize(payload, out=half)
    assert torch.equal(half, decoded.half())
    with pytest.raises(CodecError, match="3999 elements"):
        dequantize(payload, out=torch.zeros(3999))
    with pytest.raises(CodecError, match="needs out"):
        dequantize(payload, accumulate=True)
    acc = np.full(4000, 2.0, dtype=np.float32)  # a shard's accumulator
    assert dequantize(payload, out=acc, accumulate=True) is acc
    assert np.array_equal(acc, 2.0 + decoded.numpy())
    with pytest.raises(CodecError, match="numpy array: float32"):
        dequantize(payload, out=np.zeros(4000, dtype=np.float64))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_a_scaled_decode_is_bit_for_bit_the_decode_then_mul(bits: int) -> None:
    # the worker's average (pipeline/block_exchange.py): the division by the world size inside the kernel's
    # pass must give exactly what out.mul_(1 / world) gave after it, in every thread split
    old = cpu.num_threads()
    try:
        for threads, n, bucket_size in ((1, 10_007, 1024), (3, 300_001, 512)):
            cpu.set_num_threads(threads)
            x = _data(n, seed=bits) * 1e3
            for codec_payload in (quantize(x, bits, bucket_size, stochastic=True, seed=1).to_bytes(),
                                  encode(x, Codec.FP32).to_bytes()):
                for world in (2, 3, 7, 12):
                    want = dequantize(codec_payload, out=torch.empty(n)).mul_(1.0 / world)
                    for impl in ("cpu", "reference"):
                        got = dequantize(codec_payload, out=torch.full((n,), 5.0), scale=1.0 / world, impl=impl)
                        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (threads, world, impl)
    finally:
        cpu.set_num_threads(old)
    with pytest.raises(CodecError, match="scale= needs out"):
        dequantize(codec_payload, scale=0.5)


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_nonfinite_gradient_rejected(bad: float, impl: str) -> None:
    x = _data(5000)
    x[3071] = bad
    with pytest.raises(CodecError, match=r"NaN/Inf \(first at element 3071"):
        quantize(x, 4, 1024, impl=impl)
    with pytest.raises(CodecError, match="element 3071"):
        encode(x, Codec.FP32)


def test_overflowing_range_and_fp16_overflow_rejected() -> None:
    with pytest.raises(CodecError, match="overflows float32"):
        quantize(torch.tensor([-3e38, 3e38, 0.0, 1.0]), 4, 8)
    with pytest.raises(CodecError, match="overflows fp16"):
        encode(torch.tensor([1.0, 1e6]), Codec.FP16)


@pytest.mark.parametrize("bits", [0, 9, 16])
def test_bits_out_of_range(bits: int) -> None:
    with pytest.raises(CodecError, match="bits must be in 1..8"):
        quantize(torch.ones(10), bits)


@pytest.mark.parametrize("bucket_size", [0, 7, 1001, 1 << 25])
def test_bad_bucket_size(bucket_size: int) -> None:
    with pytest.raises(CodecError, match="bucket_size must be a multiple of 8"):
        quantize(torch.ones(10), 4, bucket_size)


def test_non_float_or_non_tensor_rejected() -> None:
    with pytest.raises(CodecError, match="floating-point"):
        quantize(torch.ones(10, dtype=torch.int32))
    with pytest.raises(CodecError, match="torch.Tensor"):
        quantize([1.0, 2.0])  # type: ignore[arg-type]


def _payload() -> bytes:
    return quantize(_data(3000), 4, 1024, stochastic=True).to_bytes()


def _with_header(payload: bytes, **changes: int) -> bytes:
    fields = dict(zip(["magic", "version", "codec", "bits", "flags", "numel", "bucket_size", "crc",
                       "contributors", "reserved"], struct.unpack_from("<4sBBBBQIII4s", payload)))
    fields.update(changes)
    return struct.pack("<4sBBBBQIII4s", *fields.values()) + payload[HEADER_SIZE:]


def test_a_results_contributors_travel_in_its_header_outside_the_crc() -> None:
    from cgx_ps.kernels import contributors_of, decode_header, set_contributors

    payload = bytearray(_payload())
    assert contributors_of(payload) == 0 and decode_header(payload).contributors == 0  # every node's
    set_contributors(memoryview(payload), 7)
    assert contributors_of(payload) == 7 and decode_header(payload).contributors == 7  # still valid: no crc change
    assert dequantize(bytes(payload)).equal(dequantize(_payload()))  # the values are the body's alone
    with pytest.raises(CodecError, match="contributors must be"):
        set_contributors(memoryview(payload), -1)


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda p: p[:20], "truncated: 20 bytes"),
        (lambda p: p[:-1], "payload truncated"),
        (lambda p: p + b"\0", "payload too long"),
        (lambda p: b"XXXX" + p[4:], "not a cgx-ps block"),
        (lambda p: _with_header(p, version=2), "unsupported wire version 2"),
        (lambda p: _with_header(p, codec=9), "unknown codec id 9"),
        (lambda p: _with_header(p, codec=0), "unknown codec id 0"),
        (lambda p: _with_header(p, bits=0), "bits must be in 1..8"),
        (lambda p: _with_header(p, bits=12), "bits must be in 1..8"),
        (lambda p: _with_header(p, numel=3001), "header declares 3001 elements"),
        (lambda p: _with_header(p, flags=0x80), "unknown header flags"),
        (lambda p: _with_header(p, reserved=b"\1" * 4), "reserved header bytes"),
        (lambda p: p[:-5] + bytes([p[-5] ^ 0xFF]) + p[-4:], "crc32"),
    ],
)
def test_corrupted_payloads_rejected_and_out_untouched(mangle, message: str) -> None:
    bad = mangle(_payload())
    out = torch.full((3000,), 5.0)
    with pytest.raises(CodecError, match=message):
        dequantize(bad, out=out, accumulate=True)
    assert bool((out == 5.0).all())


def test_body_crc32_is_zlibs_crc32_whichever_implementation_is_loaded() -> None:
    """The wire's crc32 is zlib's CRC-32 (docs/wire-format.md); ISA-L's, when isal is installed,
    must give the same values, over every length (its folding loop has 16/64-byte tails) and
    every kind of buffer the codecs pass (bytes, a numpy array, a memoryview slice)."""
    import zlib

    rand = np.random.default_rng(0)
    for n in [0, 1, 15, 16, 17, 63, 64, 65, 255, 4096 + 7, 1 << 20]:
        body = rand.integers(0, 256, n, dtype=np.uint8)
        payload = bytes(HEADER_SIZE) + body.tobytes()
        want = zlib.crc32(body.tobytes())
        for given in (payload, bytearray(payload), np.frombuffer(payload, dtype=np.uint8), memoryview(payload)):
            assert wire.body_crc32(given) == want, (n, type(given))
    try:
        from isal.isal_zlib import crc32 as isal_crc32
    except ImportError:
        return  # zlib's own is in use: nothing faster to check against
    assert wire._crc32 is isal_crc32  # installed, so used: the fast path is not lost silently


def _recrc(payload: bytes) -> bytes:
    return _with_header(payload, crc=wire.body_crc32(payload))


@pytest.mark.parametrize("meta_index, value", [(0, float("nan")), (1, float("inf")), (3, -1.0),
                                               (1, 3e38)])
def test_bad_metadata_with_valid_crc_rejected(meta_index: int, value: float) -> None:
    p = bytearray(_payload())
    struct.pack_into("<f", p, HEADER_SIZE + 4 * meta_index, value)
    bad = _recrc(bytes(p))
    out = torch.zeros(3000)
    with pytest.raises(CodecError, match=f"bucket {meta_index // 2} has invalid metadata"):
        dequantize(bad, out=out, accumulate=True)
    assert bool((out == 0).all())
    # a shard checks a push where gRPC left it: its metadata at any byte offset
    unaligned = memoryview(b"\0" + bad)[1:]
    with pytest.raises(CodecError, match=f"bucket {meta_index // 2} has invalid metadata"):
        check_payload(unaligned)
    assert check_payload(memoryview(b"\0" + _payload())[1:]).numel == 3000


def test_nonfinite_float_payload_rejected() -> None:
    p = bytearray(encode(torch.ones(100), Codec.FP32).to_bytes())
    struct.pack_into("<f", p, HEADER_SIZE + 4 * 17, float("nan"))
    with pytest.raises(CodecError, match="NaN/Inf \\(first at element 17\\)"):
        dequantize(_recrc(bytes(p)))


@pytest.mark.parametrize("codec", [Codec.MAXMIN, Codec.FP32, Codec.FP16, Codec.BF16])
def test_non_finite_block_is_the_header_alone_and_decodes_as_nan(codec: Codec) -> None:
    """Mixed precision: with allow_non_finite, NaN/Inf (or an fp16 overflow) becomes a flagged
    header that decodes as NaN, accumulating or not; without it, the error stays."""
    x = _data(3000, seed=1)
    x[2000] = float("inf") if codec != Codec.FP16 else 1e6  # 1e6: finite, but not in fp16
    with pytest.raises(CodecError):
        encode(x, codec, bits=4, bucket_size=24)
    payload = encode(x, codec, bits=4, bucket_size=24, allow_non_finite=True).to_bytes()
    header = decode_header(payload)
    assert len(payload) == HEADER_SIZE and header.non_finite and header.codec == codec and header.numel == 3000
    out = torch.ones(3000)
    dequantize(payload, out=out, accumulate=True)
    assert bool(out.isnan().all()) and bool(dequantize(payload).isnan().all())
    residual = ErrorFeedback()
    encode_block(_data(3000, seed=2), codec, bits=4, bucket_size=24, stochastic=True, seed=0, feedback=residual)
    kept = None if residual.residual is None else residual.residual.clone()
    encode_block(x.clone(), codec, bits=4, bucket_size=24, stochastic=True, seed=1, feedback=residual,
                 allow_non_finite=True)
    assert kept is None or torch.equal(residual.residual, kept)  # the skipped step's error is not kept


@pytest.mark.parametrize("tamper, message", [
    (lambda p: p + b"\x00" * 8, "payload too long"),  # a body after the flag
    (lambda p: p[:20] + b"\x01\x00\x00\x00" + p[24:], "payload corrupted"),  # crc of an empty body is 0
    (lambda p: p[:7] + b"\x06" + p[8:], "unknown header flags 0x06"),
])
def test_non_finite_block_is_validated(tamper, message) -> None:
    payload = encode(torch.full((64,), float("nan")), Codec.MAXMIN, bits=4, bucket_size=32,
                     allow_non_finite=True).to_bytes()
    out = torch.zeros(64)
    with pytest.raises(CodecError, match=message):
        dequantize(tamper(payload), out=out, accumulate=True)
    assert bool((out == 0).all())


def test_error_feedback_carries_what_each_encoding_left_out() -> None:
    """encode_block (workers and shards share it): the residual starts at zero, each encoding
    sees the gradient plus what the last one dropped, and the float codecs leave it alone."""
    feedback = ErrorFeedback()
    grads = [_data(3000, seed=s) for s in range(3)]
    sent, carried = torch.zeros(3000), torch.zeros(3000)
    for step, g in enumerate(grads):
        x = g.clone()
        block = encode_block(x, Codec.MAXMIN, bits=2, bucket_size=24, stochastic=True, seed=step, feedback=feedback)
        expected = encode(g + carried, Codec.MAXMIN, bits=2, bucket_size=24, stochastic=True, seed=step)
        assert block.to_bytes() == expected.to_bytes()
        decoded = dequantize(block)
        carried = g + carried - decoded
        assert torch.equal(feedback.residual, carried)
        sent += decoded
    # what was sent plus what is still carried is exactly what was produced (up to fp32 rounding)
    assert torch.allclose(sent + feedback.residual, sum(grads), atol=1e-4)
    before = feedback.residual.clone()
    plain = encode_block(grads[0].clone(), Codec.FP32, bits=32, bucket_size=0, stochastic=False, seed=0,
                         feedback=feedback)
    assert plain.to_bytes() == encode(grads[0], Codec.FP32).to_bytes() and torch.equal(feedback.residual, before)


@pytest.mark.parametrize("codec, bits", [(Codec.MAXMIN, 4), (Codec.MAXMIN, 3), (Codec.FP32, 32)])
def test_a_payload_viewed_anywhere_in_a_received_message_decodes_as_its_bytes_do(codec, bits):
    """The worker decodes results as views into the received gRPC message (client.read_result),
    at any offset: its float32 metadata is then unaligned, which must change nothing."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    payload = encode(x, codec, bits=bits, bucket_size=512, stochastic=True, seed=9).to_bytes()
    want = dequantize(payload, out=torch.empty(5000), scale=0.5)
    for offset in range(1, 8):
        message = bytes(offset) + payload + b"\x01"
        view = memoryview(message)[offset:offset + len(payload)]
        got = dequantize(view, out=torch.full((5000,), 7.0), scale=0.5)
        assert torch.equal(got, want), offset
        bad = bytearray(message)
        bad[offset + HEADER_SIZE + 3] ^= 0xFF  # in the metadata, or the float body: the crc says so
        with pytest.raises(CodecError, match="crc32"):
            dequantize(memoryview(bytes(bad))[offset:offset + len(payload)], out=torch.empty(5000))


def test_the_seed_key_in_python_integers_is_the_numpy_definitions():
    """rng.seed_key folds seeds with Python integers (per block encoded); rng.mix32 on numpy
    arrays is the definition the reference and the kernels share."""
    gen = np.random.default_rng(0)
    seeds = [0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 2**64 + 5, -1,
             *(int(s) for s in gen.integers(0, 2**63, 2000, dtype=np.int64) * 2 + 1)]
    for seed in seeds:
        folded = seed & (2**64 - 1)
        hi = rng.mix32(np.array([folded >> 32], dtype=np.uint64))
        assert rng.seed_key(seed) == int(rng.mix32(np.array([folded & 0xFFFFFFFF], dtype=np.uint64) ^ hi)[0]), seed
