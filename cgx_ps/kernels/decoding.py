"""Decoding: ``dequantize`` a wire payload (or an ``EncodedBlock``) into a float32 tensor, and
``check_payload`` / ``decode_header``: validate one without decoding it (what a shard does with
each push before it keeps it).

A payload from the wire is hostile: its header, size, crc32, max-min metadata and the values of
a float body are all checked before anything is written, so a bad payload raises CodecError and
leaves the output untouched. The output's device picks the implementation as for encoding
(``encoding.pick_impl``): CuPy kernels for CUDA, fused numba kernels for the CPU, or the
plain-torch reference.
"""

from __future__ import annotations

import numpy as np
import torch

from . import cpu, reference, wire
from .encoding import BytesLike, EncodedBlock, Impl, pick_impl
from .errors import CodecError
from .wire import HEADER_SIZE, Codec, Header, split_maxmin_body

__all__ = ["check_payload", "decode_header", "dequantize"]


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
        _validate_meta(split_maxmin_body(body, header.numel, header.bucket_size)[0], header.bits)
    else:
        _float_values(body, header)
    return header


def dequantize(
    block_or_bytes: EncodedBlock | BytesLike,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    impl: Impl = "auto",
    scale: float = 1.0,
) -> torch.Tensor:
    """Decode an EncodedBlock or a wire payload into a float32 tensor of ``numel`` elements.

    With ``out`` the result is written there (any shape with numel elements, contiguous);
    with ``accumulate=True`` it is added into ``out`` instead (the server's hot path). A payload
    from the wire is fully validated (header, size, crc32, metadata, NaN/Inf) before anything is
    written, so a bad payload raises CodecError and leaves ``out`` untouched.

    ``scale`` (with ``out``, not accumulating): the result multiplied by it, the same bits as
    ``out.mul_(scale)`` after the decode (a worker's division by the world size); the CPU kernel
    does it inside its pass over ``out``, sparing a second pass over the whole block.
    """
    if accumulate and out is None:
        raise CodecError("accumulate=True needs out=")
    if scale != 1.0 and (accumulate or out is None):
        raise CodecError("scale= needs out= and no accumulate")
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
    impl = pick_impl(impl, device)
    if header.non_finite:  # NaN + anything is NaN: accumulating or not, the result is NaN
        if target is None:
            return torch.full((header.numel,), float("nan"), dtype=torch.float32, device=device)
        return target.fill_(float("nan"))
    if impl == "cuda":
        from . import cuda

        result = cuda.decode(payload, header, target, accumulate)
        return _scaled(target, scale) if target is not None else result
    if isinstance(payload, torch.Tensor):
        payload = payload.cpu().numpy()
    body = np.frombuffer(payload, dtype=np.uint8, offset=HEADER_SIZE)
    if target is None:
        return _decode_cpu(body, header, None, False, impl)
    flat = target.view(-1)
    if flat.dtype == torch.float32:
        _decode_cpu(body, header, flat, accumulate, impl, scale)
        return target
    # decode in float32, then round once into the caller's dtype
    decoded = _decode_cpu(body, header, None, False, impl)
    flat.add_(decoded) if accumulate else flat.copy_(decoded)
    return _scaled(target, scale)


def _scaled(out: torch.Tensor, scale: float) -> torch.Tensor:
    return out.mul_(scale) if scale != 1.0 else out


def _decode_cpu(body: np.ndarray, h: Header, out: torch.Tensor | None, accumulate: bool,
                impl: str, scale: float = 1.0) -> torch.Tensor:
    """Decode into float32 ``out`` (or a new tensor), times ``scale`` (only with ``out``)."""
    if h.codec != Codec.MAXMIN:
        values = _float_values(body, h)
        if out is None:
            return torch.from_numpy(values.astype(np.float32, copy=True))
        target = out.numpy()
        if accumulate:
            np.add(target, values, out=target)
        else:
            target[:] = values
        return _scaled(out, scale)
    meta, packed = split_maxmin_body(body, h.numel, h.bucket_size)
    if not meta.flags.aligned:
        # a payload viewed inside a received message (the worker's results: client.read_result)
        # starts anywhere: the metadata (8 bytes a bucket) is copied to where float32 loads
        # belong, read-only as a payload's is: the kernels are compiled (and cached) for the
        # array types a payload of its own gives, and another type would compile anew (seconds)
        meta = meta.copy()
        meta.flags.writeable = False
    _validate_meta(meta, h.bits)
    if impl == "reference":
        m = torch.from_numpy(meta.copy()).view(-1, 2)
        values = reference.decode_maxmin(m, torch.from_numpy(packed.copy()), h.numel, h.bits,
                                         h.bucket_size)
        if out is None:
            return values
        return out.add_(values) if accumulate else _scaled(out.copy_(values), scale)
    if out is None:
        out = torch.empty(h.numel, dtype=torch.float32)
    cpu.decode_maxmin_into(meta, packed, out.numpy(), accumulate, h.bits, h.bucket_size, scale)
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
    """Every bucket's (min, unit) finite, unit >= 0, and its top level min + unit * (2**bits - 1)
    finite in float32: one kernel pass (cpu.first_bad_meta), not a dozen numpy temporaries."""
    b = cpu.first_bad_meta(meta, bits)
    if b >= 0:
        raise CodecError(
            f"bucket {b} has invalid metadata (min={meta[2 * b]}, unit={meta[2 * b + 1]}): corrupted payload?"
        )
