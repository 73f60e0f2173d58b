"""Public codec API: ``quantize``/``encode`` a tensor into an EncodedBlock, ``dequantize`` it back.

The device of the input picks the implementation: CUDA tensors use the CuPy kernels
(``cuda.py``), CPU tensors the fused numba kernels (``cpu.py``); ``impl="reference"`` forces the
plain-torch reference for tests. All three write the same bytes (docs/wire-format.md).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Literal, Union

import numpy as np
import torch

from . import cpu, reference, wire
from .errors import CodecError
from .wire import HEADER_SIZE, Codec, Header

__all__ = ["EncodedBlock", "encode", "encode_with_feedback", "quantize", "dequantize", "decode_header",
           "check_payload", "non_finite_block", "Impl", "PayloadScratch"]

if sys.byteorder != "little":  # pragma: no cover - no big-endian host runs torch training today
    raise ImportError("cgx_ps.kernels reads and writes little-endian buffers in place")

Impl = Literal["auto", "reference", "cpu", "cuda"]
BytesLike = Union[bytes, bytearray, memoryview]


@dataclass(eq=False)
class EncodedBlock:
    """One encoded tensor: a header plus its body, in a single uint8 buffer.

    ``payload`` holds ``HEADER_SIZE + body`` bytes, on the CPU (numpy) or on a CUDA device
    (torch uint8 tensor). The crc32 in the header is filled in by ``to_bytes``.
    """

    header: Header
    payload: np.ndarray | torch.Tensor

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
    def device(self) -> torch.device:
        if isinstance(self.payload, torch.Tensor):
            return self.payload.device
        return torch.device("cpu")

    def to_bytes(self) -> bytes:
        """The wire payload: header (with the body's crc32) followed by the body."""
        host = self.payload
        if isinstance(host, torch.Tensor):
            host = host.cpu().numpy()
        header = dataclasses.replace(self.header, crc32=wire.body_crc32(host))
        host[:HEADER_SIZE] = np.frombuffer(wire.pack_header(header), dtype=np.uint8)
        self.header = header
        return host.tobytes()


def quantize(
    tensor: torch.Tensor,
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
    tensor: torch.Tensor,
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
    """Encode ``tensor`` with any codec of the wire format (FP32, FP16, BF16, MAXMIN).

    A tensor holding NaN/Inf, or values the codec cannot represent (a bucket's range or an
    fp16 value overflowing), raises CodecError; with ``allow_non_finite`` it becomes instead a
    non-finite block (``non_finite_block``): the header alone, decoding as NaN everywhere.
    ``scratch``: where a CPU payload is written (one per buffer encoded every round, so the
    payload's memory is not allocated and faulted in afresh each time); the returned block's
    payload is then that memory, valid until the next encode into the same scratch.
    """
    codec = _as_codec(codec)
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise CodecError(f"expected a floating-point tensor, got {tensor.dtype}")
    wire.validate_settings(codec, bits, bucket_size)
    if codec != Codec.MAXMIN:
        bits, bucket_size = _FP_BITS[codec], 0
    impl = _pick_impl(impl, tensor.device)
    x = tensor.detach().reshape(-1)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    header = Header(codec, bits, wire.FLAG_STOCHASTIC if stochastic and codec == Codec.MAXMIN else 0,
                    x.numel(), bucket_size, 0)
    try:
        # Settings and dtype are checked above: what the kernels refuse now is the values.
        return _encode_values(x, header, seed, impl, scratch)
    except CodecError:
        if not allow_non_finite:
            raise
        return non_finite_block(codec, bits, bucket_size, x.numel())


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


def _encode_values(x: torch.Tensor, header: Header, seed: int, impl: str,
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
        _encode_maxmin_cpu(x, body, header, seed, impl)
    else:
        _encode_float_cpu(x, body, header.codec)
    return EncodedBlock(header, payload)


_FP_BITS = {Codec.FP32: 32, Codec.FP16: 16, Codec.BF16: 16}
_FP_DTYPES = {Codec.FP32: torch.float32, Codec.FP16: torch.float16, Codec.BF16: torch.bfloat16}


def _as_codec(codec: Codec | int) -> Codec:
    try:
        return Codec(int(codec))
    except ValueError:
        raise CodecError(f"unknown codec id {int(codec)}") from None


def _pick_impl(impl: Impl, device: torch.device) -> str:
    if impl == "auto":
        return "cuda" if device.type == "cuda" else "cpu"
    if impl == "cuda" and device.type != "cuda":
        raise CodecError("impl='cuda' needs a CUDA tensor")
    if impl in ("cpu", "reference") and device.type != "cpu":
        raise CodecError(f"impl={impl!r} needs a CPU tensor, got one on {device}")
    if impl not in ("cpu", "reference", "cuda"):
        raise CodecError(f"unknown impl {impl!r}")
    return impl


def _split_body(body: np.ndarray, numel: int, bucket_size: int) -> tuple[np.ndarray, np.ndarray]:
    nmeta = 2 * wire.num_buckets(numel, bucket_size)
    return body[: 4 * nmeta].view(np.float32), body[4 * nmeta:]


def _encode_maxmin_cpu(x: torch.Tensor, body: np.ndarray, h: Header, seed: int, impl: str) -> None:
    meta, packed = _split_body(body, h.numel, h.bucket_size)
    if impl == "reference":
        if not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).nonzero()[0, 0])
            raise CodecError(f"gradient contains NaN/Inf (first at element {bad}: {float(x[bad])})")
        try:
            m, p = reference.encode_maxmin(x, h.bits, h.bucket_size, h.stochastic, seed)
        except OverflowError:
            raise CodecError("a bucket's max - min overflows float32; gradient out of range") from None
        meta[:] = m.reshape(-1).numpy()
        packed[:] = p.numpy()
        return
    bad, overflow = cpu.encode_maxmin_into(x.numpy(), meta, packed, h.bits, h.bucket_size,
                                           h.stochastic, seed)
    if bad >= 0:
        chunk = x[bad * h.bucket_size: (bad + 1) * h.bucket_size]
        first = bad * h.bucket_size + int((~torch.isfinite(chunk)).nonzero()[0, 0])
        raise CodecError(f"gradient contains NaN/Inf (first at element {first}: {float(x[first])})")
    if overflow >= 0:
        raise CodecError(f"bucket {overflow}: max - min overflows float32; gradient out of range")


def _encode_float_cpu(x: torch.Tensor, body: np.ndarray, codec: Codec) -> None:
    bad = cpu.first_nonfinite(x.numpy(), "<f4")
    if bad >= 0:
        raise CodecError(f"tensor contains NaN/Inf (first at element {bad}: {float(x[bad])})")
    y = x if codec == Codec.FP32 else x.to(_FP_DTYPES[codec])
    raw = y.view(torch.uint8).numpy()
    if codec != Codec.FP32:
        bad = cpu.first_nonfinite(raw, "<f2" if codec == Codec.FP16 else "bf16")
        if bad >= 0:
            raise CodecError(f"element {bad} ({float(x[bad])}) overflows {codec.name.lower()}")
    body[:] = raw


def encode_with_feedback(tensor: torch.Tensor, residual: torch.Tensor, codec: Codec | int, *, bits: int,
                         bucket_size: int, stochastic: bool, seed: int,
                         allow_non_finite: bool = False, scratch: PayloadScratch | None = None) -> EncodedBlock:
    """Error feedback: encode ``tensor + residual`` and leave in ``residual`` what the encoding
    left out, to be added next time. ``tensor`` is updated in place (it holds the sum). A
    non-finite block (``allow_non_finite``) leaves the residual as it was: that step's gradient
    is thrown away by every rank (a loss scaler skips it), its error with it."""
    tensor.add_(residual)
    encoded = encode(tensor, codec, bits=bits, bucket_size=bucket_size, stochastic=stochastic, seed=seed,
                     allow_non_finite=allow_non_finite, scratch=scratch)
    if encoded.header.non_finite:
        return encoded
    dequantize(encoded, out=residual)
    residual.neg_().add_(tensor)
    return encoded


def decode_header(payload: BytesLike) -> Header:
    """Parse and validate a payload's header (sizes included); does not check the crc."""
    return wire.parse_header(payload)


def check_payload(payload: BytesLike) -> Header:
    """Validate a wire payload as ``dequantize`` does before it writes anything (header, size,
    crc32, max-min metadata, NaN/Inf in a float body), without decoding it; its header."""
    header = wire.parse_header(payload)
    wire.check_crc(payload, header)
    if header.non_finite:
        return header
    body = np.frombuffer(payload, dtype=np.uint8, offset=HEADER_SIZE)
    if header.codec == Codec.MAXMIN:
        _validate_meta(_split_body(body, header.numel, header.bucket_size)[0], header.bits)
    else:
        _float_values(body, header)
    return header


def dequantize(
    block_or_bytes: EncodedBlock | BytesLike,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Decode an EncodedBlock or a wire payload into a float32 tensor of ``numel`` elements.

    With ``out`` the result is written there (any shape with numel elements, contiguous);
    with ``accumulate=True`` it is added into ``out`` instead (the server's hot path). A payload
    from the wire is fully validated (header, size, crc32, metadata, NaN/Inf) before anything is
    written, so a bad payload raises CodecError and leaves ``out`` untouched.
    """
    if accumulate and out is None:
        raise CodecError("accumulate=True needs out=")
    if isinstance(block_or_bytes, EncodedBlock):
        header, payload = block_or_bytes.header, block_or_bytes.payload
    else:
        payload = block_or_bytes
        header = wire.parse_header(payload)
        wire.check_crc(payload, header)
    target = out
    if target is not None:
        if target.numel() != header.numel:
            raise CodecError(f"out has {target.numel()} elements, the block holds {header.numel}")
        if not target.is_contiguous():
            raise CodecError("out must be contiguous")
        if not target.is_floating_point():
            raise CodecError(f"out must be a floating-point tensor, got {target.dtype}")
    device = target.device if target is not None else (
        payload.device if isinstance(payload, torch.Tensor) else torch.device("cpu"))
    impl = _pick_impl(impl, device)
    if header.non_finite:  # NaN + anything is NaN: accumulating or not, the result is NaN
        if target is None:
            return torch.full((header.numel,), float("nan"), dtype=torch.float32, device=device)
        return target.fill_(float("nan"))
    if impl == "cuda":
        from . import cuda

        result = cuda.decode(payload, header, target, accumulate)
        return target if target is not None else result
    if isinstance(payload, torch.Tensor):
        payload = payload.cpu().numpy()
    body = np.frombuffer(payload, dtype=np.uint8, offset=HEADER_SIZE)
    if target is None:
        return _decode_cpu(body, header, None, False, impl)
    flat = target.view(-1)
    if flat.dtype == torch.float32:
        _decode_cpu(body, header, flat, accumulate, impl)
    else:  # decode in float32, then round once into the caller's dtype
        decoded = _decode_cpu(body, header, None, False, impl)
        flat.add_(decoded) if accumulate else flat.copy_(decoded)
    return target


def _decode_cpu(body: np.ndarray, h: Header, out: torch.Tensor | None, accumulate: bool,
                impl: str) -> torch.Tensor:
    if h.codec != Codec.MAXMIN:
        values = _float_values(body, h)
        if out is None:
            return torch.from_numpy(values.astype(np.float32, copy=True))
        target = out.numpy()
        if accumulate:
            np.add(target, values, out=target)
        else:
            target[:] = values
        return out
    meta, packed = _split_body(body, h.numel, h.bucket_size)
    _validate_meta(meta, h.bits)
    if impl == "reference":
        m = torch.from_numpy(meta.copy()).view(-1, 2)
        values = reference.decode_maxmin(m, torch.from_numpy(packed.copy()), h.numel, h.bits,
                                         h.bucket_size)
        if out is None:
            return values
        return out.add_(values) if accumulate else out.copy_(values)
    if out is None:
        out = torch.empty(h.numel, dtype=torch.float32)
    cpu.decode_maxmin_into(meta, packed, out.numpy(), accumulate, h.bits, h.bucket_size)
    return out


def _float_values(body: np.ndarray, h: Header) -> np.ndarray:
    """The body of an FP32/FP16/BF16 payload as a numpy array (a view where possible)."""
    kind = {Codec.FP32: "<f4", Codec.FP16: "<f2", Codec.BF16: "bf16"}[h.codec]
    bad = cpu.first_nonfinite(body, kind)
    if bad >= 0:
        raise CodecError(f"payload contains NaN/Inf (first at element {bad})")
    if h.codec == Codec.FP32:
        return body.view("<f4")
    if h.codec == Codec.FP16:
        return body.view("<f2")
    # bfloat16 is the top half of a float32
    return (body.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)


def _validate_meta(meta: np.ndarray, bits: int) -> None:
    pairs = meta.reshape(-1, 2)
    mn, unit = pairs[:, 0], pairs[:, 1]
    with np.errstate(over="ignore", invalid="ignore"):
        top = mn + unit * np.float32((1 << bits) - 1)
    ok = np.isfinite(mn) & np.isfinite(unit) & (unit >= 0) & np.isfinite(top)
    if not ok.all():
        b = int(np.argmin(ok))
        raise CodecError(
            f"bucket {b} has invalid metadata (min={mn[b]}, unit={unit[b]}): corrupted payload?"
        )
