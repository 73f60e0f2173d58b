"""CUDA codec (cgx_ps/kernels/cuda/): compiles everywhere nvcc is, and on a GPU writes the same
bytes as the reference and decodes exactly as the CPU kernel does."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from cgx_ps.kernels import HEADER_SIZE, Codec, CodecError, dequantize, encode, quantize, wire
from cgx_ps.kernels import cuda as cuda_codec


def _gpu_ready() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy  # noqa: F401
    except Exception:  # a CuPy that cannot load its CUDA libraries counts as absent
        return False
    return True


def _data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-4, 1, n).roll(n // 3) if n else torch.zeros(0)
    if n > 64:
        x[10:30] = 0.25  # a constant run: a bucket of 8 with unit 0
        x[31] = -0.0     # the reference stores +0.0 for a -0.0 extreme
    return x


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (tells -0.0 from +0.0), on the CPU."""
    a, b = a.detach().cpu(), b.detach().cpu()
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


# ---- runs everywhere ---------------------------------------------------------------------------


def test_kernel_source_compiles_with_nvcc(tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    src = tmp_path / "maxmin.cu"
    src.write_text(cuda_codec.CUDA_SOURCE)
    # Without --fmad=false: the round-to-nearest intrinsics alone must keep FMAs out, so the
    # bytes cannot depend on compiler flags.
    for options in (cuda_codec.NVRTC_OPTIONS, ()):
        ptx = tmp_path / "maxmin.ptx"
        done = subprocess.run([nvcc, "-arch=sm_80", "-ptx", *options, "-o", str(ptx), str(src)],
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr
        text = ptx.read_text()
        for name in cuda_codec.KERNEL_NAMES:
            assert f".entry {name}(" in text
        assert "fma." not in text


def test_block_size_matches_source() -> None:
    assert f"#define BLOCK {cuda_codec.BLOCK}\n" in cuda_codec.CUDA_SOURCE


def test_calls_without_cupy_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    header = wire.Header(Codec.MAXMIN, 4, 0, 8, 8, 0)
    with pytest.raises(ImportError, match=r"cgx-ps\[cuda12\].*cgx-ps\[cuda13\]"):
        cuda_codec.encode(torch.zeros(8), header, 0)
    with pytest.raises(ImportError, match=r"cgx-ps\[cuda12\]"):
        cuda_codec.decode(bytes(HEADER_SIZE + header.body_size), header, None, False)


def test_import_does_not_load_cupy() -> None:
    code = "import sys, cgx_ps.kernels.cuda; print('cupy' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


class _NoCupy:
    """Stands in for the CuPy module: any use of it fails the test, so a launch check that does
    not run before the first CuPy call is caught."""

    def __getattr__(self, name: str):
        raise AssertionError(f"cupy.{name} used before the launch was checked")


def _aligned(nbytes: int, offset: int = 0) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose first byte is ``offset`` bytes past a 16-byte boundary."""
    buf = torch.zeros(nbytes + 32, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 16 + offset
    return buf[start:start + nbytes]


def test_launches_with_wrong_sizes_are_refused_before_cupy_is_touched() -> None:
    """The low-level entry points (benchmarks and the public API call them) check every size, dtype,
    layout and device the kernels rely on before any CuPy call: a wrong one never reaches the GPU,
    where it would write out of bounds. With the right sizes, CPU tensors get as far as the device
    check, so each size check below is the one that refuses."""
    n, bucket = 1000, 64
    h = wire.Header(Codec.MAXMIN, 4, 0, n, bucket, 0)
    full = HEADER_SIZE + h.body_size
    x, payload, out = torch.zeros(n), _aligned(full), torch.zeros(n)
    cp = _NoCupy()

    def encode_refused(match: str, **changed) -> None:
        args = {"x": x, "payload": payload, "header": h, **changed}
        with pytest.raises(CodecError, match=match):
            cuda_codec.encode_maxmin_async(cp, args["x"], args["payload"], args["header"], 7)

    def decode_refused(match: str, **changed) -> None:
        args = {"payload": payload, "header": h, "out": out, **changed}
        with pytest.raises(CodecError, match=match):
            cuda_codec.decode_maxmin_async(cp, args["payload"], args["header"], args["out"], True)
        if "out" not in changed:  # the metadata check reads the same payload
            with pytest.raises(CodecError, match=match.replace("maxmin_decode", "maxmin_check_meta")):
                cuda_codec.codec._check_meta(cp, args["payload"], args["header"])

    encode_refused(r"maxmin_encode: input is on cpu, expected a CUDA device")  # every size right
    encode_refused(r"input has 999 elements, the header needs exactly 1000", x=torch.zeros(n - 1))
    encode_refused(r"input has 1001 elements", x=torch.zeros(n + 1))
    encode_refused(r"input dtype is torch.float16, expected torch.float32", x=torch.zeros(n, dtype=torch.float16))
    encode_refused(r"input must be contiguous", x=torch.zeros(n, 2)[:, 0])
    encode_refused(rf"payload has {full - 1} elements, the header needs exactly {full}", payload=_aligned(full - 1))
    encode_refused(rf"payload has {full + 8} elements", payload=_aligned(full + 8))
    encode_refused(r"payload dtype is torch.int8", payload=_aligned(full).view(torch.int8))
    encode_refused(r"payload address 0x[0-9a-f]+ is not 16-byte aligned", payload=_aligned(full, offset=4))
    encode_refused(r"header codec is FP32, expected MAXMIN", header=wire.Header(Codec.FP32, 32, 0, n, 0, 0))
    encode_refused(r"bits must be in 1..8", header=wire.Header(Codec.MAXMIN, 9, 0, n, bucket, 0))
    encode_refused(r"bucket_size must be a multiple of 8", header=wire.Header(Codec.MAXMIN, 4, 0, n, 12, 0))
    encode_refused(r"the header needs exactly", header=wire.Header(Codec.MAXMIN, 4, 0, n + 8, bucket, 0))
    # a non-finite block's header declares no body at all: the kernel would write the metadata past it
    encode_refused(r"header has the non-finite flag", payload=_aligned(HEADER_SIZE),
                   header=wire.Header(Codec.MAXMIN, 4, wire.FLAG_NONFINITE, n, bucket, 0))

    decode_refused(r"maxmin_decode: payload is on cpu, expected a CUDA device")
    decode_refused(rf"maxmin_decode: payload has {full - 1} elements, the header needs exactly {full}",
                   payload=_aligned(full - 1))
    decode_refused(r"payload address 0x[0-9a-f]+ is not 16-byte aligned", payload=_aligned(full, offset=8))
    decode_refused(r"maxmin_decode: header codec is BF16", header=wire.Header(Codec.BF16, 16, 0, n, 0, 0))
    decode_refused(r"maxmin_decode: header has the non-finite flag", payload=_aligned(HEADER_SIZE),
                   header=wire.Header(Codec.MAXMIN, 4, wire.FLAG_NONFINITE, n, bucket, 0))
    decode_refused(r"output has 999 elements, the header needs exactly 1000", out=torch.zeros(n - 1))
    decode_refused(r"output dtype is torch.bfloat16", out=torch.zeros(n, dtype=torch.bfloat16))
    decode_refused(r"output must be contiguous", out=torch.zeros(n, 2)[:, 1])
    # a header claiming more elements than the output holds: the decode would write past it
    decode_refused(r"the header needs exactly", header=wire.Header(Codec.MAXMIN, 4, 0, 2 * n, bucket, 0))


def test_kernel_arguments_point_into_the_payload_where_the_wire_format_says() -> None:
    """The kernels take raw device pointers (no DLPack import per call): the metadata starts right
    after the header, the packed levels after 8 bytes per bucket, and the stochastic key is
    rng.seed_key's, the CPU kernel's."""
    from cgx_ps.kernels import rng

    n, bucket = 5003, 1024
    for flags, key in ((wire.FLAG_STOCHASTIC, rng.seed_key(12_345_678_901)), (0, 0)):
        h = wire.Header(Codec.MAXMIN, 3, flags, n, bucket, 0)
        x, payload, status = torch.zeros(n), _aligned(HEADER_SIZE + h.body_size), torch.zeros(2, dtype=torch.int64)
        args = cuda_codec.encode_args(x, payload, h, 12_345_678_901, status)
        meta = payload.data_ptr() + HEADER_SIZE
        assert [int(a) for a in args] == [x.data_ptr(), n, bucket, 3, 128, int(bool(flags)), key, meta,
                                          meta + 8 * 5, status.data_ptr()]
        assert [a.dtype.itemsize for a in args] == [8, 8, 4, 4, 4, 4, 4, 8, 8, 8]  # the kernel's parameter widths
        out = torch.zeros(n)
        args = cuda_codec.decode_args(payload, h, out, True)
        assert [int(a) for a in args] == [meta, meta + 8 * 5, n, bucket, 3, 1, out.data_ptr()]
        assert [a.dtype.itemsize for a in args] == [8, 8, 8, 4, 4, 4, 8]
    # one thread per group of 8, a power of two up to the whole block of 256
    assert [cuda_codec.threads_per_bucket(b) for b in (8, 16, 24, 256, 1024, 2048, 4096, 16384)] == \
        [1, 2, 4, 32, 128, 256, 256, 256]


# ---- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA device and CuPy")
class TestOnGPU:
    @pytest.mark.parametrize("bits", range(1, 9))
    @pytest.mark.parametrize("stochastic", [False, True])
    @pytest.mark.parametrize("bucket_size", [8, 24, 1024, 4096, 16384])
    def test_encode_byte_identical_to_reference(self, bits: int, stochastic: bool,
                                                bucket_size: int) -> None:
        # 0 and 1 element, odd lengths, partial last buckets; 16384 takes the reload path
        for n in (0, 1, 7, 9, 1023, 1025, 5003):
            x = _data(n, seed=n + bits)
            seed = 12_345_678_901 + bits
            ref = quantize(x, bits, bucket_size, stochastic=stochastic, seed=seed, impl="reference")
            got = quantize(x.cuda(), bits, bucket_size, stochastic=stochastic, seed=seed)
            assert isinstance(got.payload, torch.Tensor) and got.payload.is_cuda
            assert got.to_bytes() == ref.to_bytes(), n

    @pytest.mark.parametrize("bits", [1, 3, 4, 8])
    def test_unaligned_input_and_side_stream(self, bits: int) -> None:
        x = _data(10_007, seed=bits)
        ref = quantize(x, bits, 1024, stochastic=True, seed=5, impl="reference").to_bytes()
        buf = torch.zeros(x.numel() + 1, device="cuda")
        buf[1:] = x.cuda()
        unaligned = buf[1:]  # 4 bytes past 16-byte alignment: the scalar-load path
        assert quantize(unaligned, bits, 1024, stochastic=True, seed=5).to_bytes() == ref
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got = quantize(unaligned, bits, 1024, stochastic=True, seed=5)
        assert got.to_bytes() == ref

    @pytest.mark.parametrize("bits", range(1, 9))
    @pytest.mark.parametrize("bucket_size", [8, 1024])
    def test_decode_matches_cpu(self, bits: int, bucket_size: int) -> None:
        for n in (1, 9, 1025, 5003):
            payload = quantize(_data(n, seed=bits), bits, bucket_size, stochastic=True,
                               seed=1).to_bytes()
            expect = dequantize(payload, impl="cpu")
            gpu_block = quantize(_data(n, seed=bits).cuda(), bits, bucket_size, stochastic=True,
                                 seed=1)
            assert _bits_equal(dequantize(gpu_block), expect)  # device payload, new tensor
            base = torch.randn(n + 1)
            for acc in (False, True):
                want = dequantize(payload, out=base[:n].clone(), accumulate=acc, impl="cpu")
                out = base[:n].cuda()
                dequantize(payload, out=out, accumulate=acc)  # host bytes, float4 path
                assert _bits_equal(out, want), (n, acc)
                out = base.cuda()[1:]  # 4 bytes off 16-byte alignment: scalar path
                want = dequantize(payload, out=base[1:].clone(), accumulate=acc, impl="cpu")
                dequantize(gpu_block, out=out, accumulate=acc)
                assert _bits_equal(out, want), (n, acc)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_decode_into_half_targets(self, dtype: torch.dtype) -> None:
        payload = quantize(_data(3001), 4, 1024, seed=2).to_bytes()
        base = torch.randn(3001).to(dtype)
        for acc in (False, True):
            want = dequantize(payload, out=base.clone(), accumulate=acc, impl="cpu")
            out = base.cuda()
            dequantize(payload, out=out, accumulate=acc)
            assert _bits_equal(out, want)

    def test_empty_and_one_element(self) -> None:
        for n in (0, 1):
            block = quantize(torch.full((n,), 3.5, device="cuda"), 4, 1024)
            y = dequantize(block)
            assert y.is_cuda and y.shape == (n,) and bool((y == 3.5).all())
            y = dequantize(block.to_bytes(), out=torch.ones(n, device="cuda"), accumulate=True)
            assert bool((y == 4.5).all())

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
    def test_nonfinite_gradient_rejected(self, bad: float) -> None:
        x = _data(50_000).cuda()
        x[[41_000, 1234, 30_000]] = bad  # the lowest index is named, across buckets and blocks
        for bits, stochastic in ((4, True), (2, False)):
            with pytest.raises(CodecError, match="first at element 1234"):
                quantize(x, bits, 1024, stochastic=stochastic)
        for codec in (Codec.FP32, Codec.FP16, Codec.BF16):
            with pytest.raises(CodecError, match="first at element 1234"):
                encode(x, codec)

    def test_overflowing_range_and_fp16_overflow_rejected(self) -> None:
        x = torch.zeros(4096, device="cuda")
        x[2050], x[2051] = -3e38, 3e38
        with pytest.raises(CodecError, match="bucket 2"):
            quantize(x, 4, 1024)
        with pytest.raises(CodecError, match="element 2050 .* overflows fp16"):
            encode(x, Codec.FP16)

    @pytest.mark.parametrize("index, value, bucket", [
        (0, float("nan"), 0), (3, float("inf"), 1), (5, -1.0, 2), (6, 3e38, 3),
    ])
    def test_bad_metadata_rejected_and_out_untouched(self, index: int, value: float,
                                                     bucket: int) -> None:
        block = quantize(_data(5000).cuda(), 4, 1024)
        raw = bytearray(block.to_bytes())
        meta = np.frombuffer(raw, dtype="<f4", count=10, offset=HEADER_SIZE)
        meta[index] = value
        if value == 3e38:
            meta[index + 1] = 1e37  # min + unit * 15 overflows
        header = dataclasses.replace(block.header, crc32=zlib.crc32(raw[HEADER_SIZE:]))
        raw[:HEADER_SIZE] = wire.pack_header(header)  # a valid crc: only the metadata is wrong
        out = torch.full((5000,), 7.0, device="cuda")
        for acc in (False, True):
            with pytest.raises(CodecError, match=f"bucket {bucket} has invalid metadata"):
                dequantize(bytes(raw), out=out, accumulate=acc)
            assert bool((out == 7.0).all())
        device_payload = torch.frombuffer(raw, dtype=torch.uint8).cuda()
        with pytest.raises(CodecError, match=f"bucket {bucket} "):
            cuda_codec.decode(device_payload, header, out, True)  # no crc on this path
        assert bool((out == 7.0).all())

    @pytest.mark.parametrize("codec", [Codec.FP32, Codec.FP16, Codec.BF16])
    def test_float_codecs_round_trip(self, codec: Codec) -> None:
        x = _data(10_007)
        ref = encode(x, codec, impl="cpu")
        got = encode(x.cuda(), codec)
        assert got.to_bytes() == ref.to_bytes()
        expect = dequantize(ref.to_bytes(), impl="cpu")
        assert _bits_equal(dequantize(got), expect)
        out = torch.ones(10_007, device="cuda")
        dequantize(got.to_bytes(), out=out, accumulate=True)
        assert _bits_equal(out, dequantize(ref.to_bytes(), out=torch.ones(10_007), accumulate=True))
        bad = bytearray(ref.to_bytes())
        bad[HEADER_SIZE: HEADER_SIZE + 4] = b"\xff\xff\xff\xff"  # a NaN in every codec
        header = dataclasses.replace(ref.header, crc32=zlib.crc32(bad[HEADER_SIZE:]))
        bad[:HEADER_SIZE] = wire.pack_header(header)
        with pytest.raises(CodecError, match="NaN/Inf"):
            dequantize(bytes(bad), out=out)
        assert bool(torch.isfinite(out).all())

    def test_large_tensor(self) -> None:
        n = 25_000_000
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        ref = quantize(x, 4, 1024, stochastic=True, seed=7, impl="cpu")  # == reference, tested
        got = quantize(x.cuda(), 4, 1024, stochastic=True, seed=7)
        assert got.to_bytes() == ref.to_bytes()
        acc = torch.randn(n, generator=torch.Generator().manual_seed(1))
        want = dequantize(ref, out=acc.clone(), accumulate=True, impl="cpu")
        out = acc.cuda()
        dequantize(got, out=out, accumulate=True)
        assert _bits_equal(out, want)
