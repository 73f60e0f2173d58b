"""Encoding: ``quantize``/``encode`` a tensor into an ``EncodedBlock`` of the wire format
(``decoding.py`` reads it back).

The device of the input picks the implementation (``pick_impl``): CUDA tensors use the CuPy
kernels (``cuda/``), CPU tensors and numpy arrays the fused numba kernels (``cpu.py``; a shard
encodes numpy arrays and never imports torch, which spares each shard process torch's ~190 MiB and
a second or more of CPU at every start; ``is_tensor`` and ``host_view`` tell the two kinds apart
without importing it); ``impl="reference"`` forces the plain-torch reference for tests. All three
write the same bytes (docs/wire-format.md).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Literal, Union

import numpy as np

from . import cpu, wire
from .errors import CodecError
from .wire import HEADER_SIZE, Codec, Header, split_maxmin_body

__all__ = ["BytesLike", "EncodedBlock", "Impl", "PayloadScratch", "device_type", "encode", "host_view", "is_tensor",
           "non_finite_block", "pick_impl", "quantize", "torch_module"]

if sys.byteorder != "little":  # pragma: no cover - no big-endian host runs torch training today
    raise ImportError("cgx_ps.kernels reads and writes little-endian buffers in place")

# ---- the arrays the codecs take: numpy arrays, or torch tensors where the caller has torch ----------


def is_tensor(x: Any) -> bool:
    """Is ``x`` a torch tensor? (False, without importing torch, where nothing imported it.)"""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def device_type(x: Any) -> str:
    """"cuda" for a CUDA tensor, else "cpu" (numpy arrays, bytes, CPU tensors)."""
    return x.device.type if is_tensor(x) else "cpu"


def host_view(x: Any) -> np.ndarray:
    """A CPU array's memory as a numpy array: a numpy array as it is, a CPU tensor's ``.numpy()``
    view (writes through to the tensor)."""
    return x.numpy() if is_tensor(x) else x


def torch_module() -> Any:
    """torch, imported on first use: only the plain-torch reference implementation and results
    returned to a caller without an ``out`` need it."""
    import torch

    return torch


Impl = Literal["auto", "reference", "cpu", "cuda"]
BytesLike = Union[bytes, bytearray, memoryview]


@dataclass(eq=False)
class EncodedBlock:
    """One encoded tensor: a header plus its body, in a single uint8 buffer.

    ``payload`` holds ``HEADER_SIZE + body`` bytes, on the CPU (numpy) or on a CUDA device
    (torch uint8 tensor). The crc32 in the header is filled in by ``to_bytes``.
    """

    header: Header
    payload: Any  # np.ndarray, or a CUDA torch.Tensor

    @property
    def codec(self) -> Codec:
        return self.header.codec

    @property
    def numel(self) -> int:
        return self.header.numel

    @property
    def bits(self) -> int:
        return self.header.bits

    @property
    def bucket_size(self) -> int:
        return self.header.bucket_size

    @property
    def nbytes(self) -> int:
        return HEADER_SIZE + self.header.body_size

    @property
    def device(self) -> Any:
        """The payload's torch.device (imports torch)."""
        return self.payload.device if is_tensor(self.payload) else torch_module().device("cpu")

    def to_bytes(self) -> bytes:
        """The wire payload: header (with the body's crc32) followed by the body."""
        return self.stamped().tobytes()

    def stamped(self) -> memoryview:
        """The wire payload without a copy: the body's crc32 written into the header, and the
        payload's own memory (a CPU payload; a CUDA one is copied to the host first) viewed.
        It changes when its ``PayloadScratch`` is encoded into again: frame or copy it before."""
        host = self.payload
        if device_type(host) == "cuda":
            from . import cuda

            host = cuda.to_host(host)  # pinned, waiting on the encoding stream only
        elif is_tensor(host):
            host = host.numpy()
        header = dataclasses.replace(self.header, crc32=wire.body_crc32(host))
        host[:HEADER_SIZE] = np.frombuffer(wire.pack_header(header), dtype=np.uint8)
        self.header = header
        return memoryview(host)


def quantize(
    tensor: Any,
    bits: int = 4,
    bucket_size: int = 1024,
    *,
    stochastic: bool = False,
    seed: int = 0,
    impl: Impl = "auto",
) -> EncodedBlock:
    """Max-min bucketed quantization (CGX) of ``tensor`` (flattened) to ``bits`` bits.

    Per bucket of ``bucket_size`` elements: ``unit = (max - min) / (2**bits - 1)``,
    ``level = floor((x - min) / unit + r)`` with r = 0.5 (nearest) or r = uniform(seed, index)
    (stochastic, unbiased, reproducible). Raises CodecError on NaN/Inf or bad settings.
    """
    return encode(tensor, Codec.MAXMIN, bits=bits, bucket_size=bucket_size,
                  stochastic=stochastic, seed=seed, impl=impl)


def encode(
    tensor: Any,
    codec: Codec | int = Codec.MAXMIN,
    *,
    bits: int = 4,
    bucket_size: int = 1024,
    stochastic: bool = False,
    seed: int = 0,
    impl: Impl = "auto",
    allow_non_finite: bool = False,
    scratch: PayloadScratch | None = None,
) -> EncodedBlock:
    """Encode ``tensor`` (a torch tensor or a numpy array, any floating-point dtype) with any
    codec of the wire format (FP32, FP16, BF16, MAXMIN).

    A tensor holding NaN/Inf, or values the codec cannot represent (a bucket's range or an
    fp16 value overflowing), raises CodecError; with ``allow_non_finite`` it becomes instead a
    non-finite block (``non_finite_block``): the header alone, decoding as NaN everywhere.
    ``scratch``: where a CPU payload is written (one per buffer encoded every round, so the
    payload's memory is not allocated and faulted in afresh each time); the returned block's
    payload is then that memory, valid until the next encode into the same scratch.
    """
    codec = _as_codec(codec)
    x = _flat_float32(tensor)
    numel = x.numel() if is_tensor(x) else x.size
    wire.validate_settings(codec, bits, bucket_size)
    if codec != Codec.MAXMIN:
        bits, bucket_size = _FP_BITS[codec], 0
    impl = pick_impl(impl, device_type(x))
    header = Header(codec, bits, wire.FLAG_STOCHASTIC if stochastic and codec == Codec.MAXMIN else 0,
                    numel, bucket_size, 0)
    try:
        # Settings and dtype are checked above: what the kernels refuse now is the values.
        return _encode_values(x, header, seed, impl, scratch)
    except CodecError:
        if not allow_non_finite:
            raise
        return non_finite_block(codec, bits, bucket_size, numel)


def _flat_float32(tensor: Any) -> Any:
    """``tensor`` flat, contiguous and float32, of its own kind (a view where it is already)."""
    if is_tensor(tensor):
        if not tensor.is_floating_point():
            raise CodecError(f"expected a floating-point tensor, got {tensor.dtype}")
        torch = torch_module()
        x = tensor.detach().reshape(-1)
        return x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    if isinstance(tensor, np.ndarray):
        if tensor.dtype.kind != "f":
            raise CodecError(f"expected a floating-point array, got {tensor.dtype}")
        return np.ascontiguousarray(tensor.reshape(-1), dtype=np.float32)
    raise CodecError(f"expected a torch.Tensor or a numpy array, got {type(tensor).__name__}")


def non_finite_block(codec: Codec | int, bits: int, bucket_size: int, numel: int) -> EncodedBlock:
    """The block of a tensor that was not finite: its header (with ``FLAG_NONFINITE``) alone."""
    codec = _as_codec(codec)
    if codec != Codec.MAXMIN:
        bits, bucket_size = _FP_BITS[codec], 0
    header = Header(codec, bits, wire.FLAG_NONFINITE, numel, bucket_size, 0)
    return EncodedBlock(header, np.frombuffer(wire.pack_header(header), dtype=np.uint8).copy())


class PayloadScratch:
    """A CPU payload buffer reused across encodes of one buffer. Reused only for the same
    header settings and size: the kernels may leave padding bytes unwritten, and those must be
    the zeros of a fresh buffer for the payload (and its crc) to be the same bytes as before."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._payload: np.ndarray | None = None

    def payload(self, header: Header) -> np.ndarray:
        key = (header.codec, header.bits, header.bucket_size, header.numel, header.flags)
        if key != self._key or self._payload is None:
            self._payload = np.zeros(HEADER_SIZE + header.body_size, dtype=np.uint8)
            self._key = key
        return self._payload


def _encode_values(x: Any, header: Header, seed: int, impl: str,
                   scratch: PayloadScratch | None = None) -> EncodedBlock:
    if impl == "cuda":
        from . import cuda

        return EncodedBlock(header, cuda.encode(x, header, seed))
    if scratch is None:
        payload = np.zeros(HEADER_SIZE + header.body_size, dtype=np.uint8)
    else:
        payload = scratch.payload(header)
    payload[:HEADER_SIZE] = np.frombuffer(wire.pack_header(header), dtype=np.uint8)
    body = payload[HEADER_SIZE:]
    if header.codec == Codec.MAXMIN:
        _encode_maxmin_cpu(host_view(x), body, header, seed, impl)
    else:
        _encode_float_cpu(host_view(x), body, header.codec)
    return EncodedBlock(header, payload)


_FP_BITS = {Codec.FP32: 32, Codec.FP16: 16, Codec.BF16: 16}


def _as_codec(codec: Codec | int) -> Codec:
    try:
        return Codec(int(codec))
    except ValueError:
        raise CodecError(f"unknown codec id {int(codec)}") from None


def pick_impl(impl: Impl, device: str) -> str:
    """The implementation that runs for an array on ``device`` ("cpu" or "cuda"; "auto": its
    device's), or CodecError if the one asked for cannot."""
    if impl == "auto":
        return "cuda" if device == "cuda" else "cpu"
    if impl == "cuda" and device != "cuda":
        raise CodecError("impl='cuda' needs a CUDA tensor")
    if impl in ("cpu", "reference") and device != "cpu":
        raise CodecError(f"impl={impl!r} needs a CPU tensor, got one on {device}")
    if impl not in ("cpu", "reference", "cuda"):
        raise CodecError(f"unknown impl {impl!r}")
    return impl


def _encode_maxmin_cpu(x: np.ndarray, body: np.ndarray, h: Header, seed: int, impl: str) -> None:
    meta, packed = split_maxmin_body(body, h.numel, h.bucket_size)
    if impl == "reference":
        from . import reference

        if not np.isfinite(x).all():
            bad = int(np.flatnonzero(~np.isfinite(x))[0])
            raise CodecError(f"gradient contains NaN/Inf (first at element {bad}: {float(x[bad])})")
        try:
            m, p = reference.encode_maxmin(torch_module().from_numpy(x), h.bits, h.bucket_size, h.stochastic, seed)
        except OverflowError:
            raise CodecError("a bucket's max - min overflows float32; gradient out of range") from None
        meta[:] = m.reshape(-1).numpy()
        packed[:] = p.numpy()
        return
    bad, overflow = cpu.encode_maxmin_into(x, meta, packed, h.bits, h.bucket_size, h.stochastic, seed)
    if bad >= 0:
        chunk = x[bad * h.bucket_size: (bad + 1) * h.bucket_size]
        first = bad * h.bucket_size + int(np.flatnonzero(~np.isfinite(chunk))[0])
        raise CodecError(f"gradient contains NaN/Inf (first at element {first}: {float(x[first])})")
    if overflow >= 0:
        raise CodecError(f"bucket {overflow}: max - min overflows float32; gradient out of range")


def _encode_float_cpu(x: np.ndarray, body: np.ndarray, codec: Codec) -> None:
    bad = cpu.first_nonfinite(x, "<f4")
    if bad >= 0:
        raise CodecError(f"tensor contains NaN/Inf (first at element {bad}: {float(x[bad])})")
    if codec == Codec.FP32:
        raw = x.view(np.uint8)
    elif codec == Codec.FP16:
        with np.errstate(over="ignore"):  # a value past fp16's range becomes Inf, refused below
            raw = x.astype(np.float16).view(np.uint8)  # round to nearest even, as torch's .half()
    else:
        raw = _to_bfloat16(x).view(np.uint8)
    if codec != Codec.FP32:
        bad = cpu.first_nonfinite(raw, "<f2" if codec == Codec.FP16 else "bf16")
        if bad >= 0:
            raise CodecError(f"element {bad} ({float(x[bad])}) overflows {codec.name.lower()}")
    body[:] = raw


def _to_bfloat16(x: np.ndarray) -> np.ndarray:
    """Finite float32 values as bfloat16 bits: the top half of each, rounded to nearest even, as
    torch's float -> bfloat16 conversion (c10/util/BFloat16.h) rounds them (numpy has no bfloat16).
    A value that rounds past the largest bfloat16 becomes Inf, which the caller refuses."""
    u = x.view(np.uint32)
    one, sixteen = np.uint32(1), np.uint32(16)
    return ((u + (np.uint32(0x7FFF) + ((u >> sixteen) & one))) >> sixteen).astype(np.uint16)
