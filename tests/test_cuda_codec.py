"""CUDA codec (cgx_ps/kernels/cuda.py): compiles everywhere nvcc is, and on a GPU writes the same
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
