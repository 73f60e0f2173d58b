"""Decoding: ``dequantize`` a wire payload (or an ``EncodedBlock``) into a float32 tensor, and
``check_payload`` / ``decode_header``: validate one without decoding it (what a shard does with
each push before it keeps it).

A payload from the wire is hostile: its header, size, crc32, max-min metadata and the values of
a float body are all checked before anything is written, so a bad payload raises CodecError and
leaves the output untouched. The output's device picks the implementation as for encoding
(``encoding.pick_impl``): CuPy kernels for CUDA, fused numba kernels for the CPU (a torch
tensor's memory, or a numpy array: a shard's sums, ``encoding.is_tensor``), or the plain-torch reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import cpu, wire
from .encoding import BytesLike, EncodedBlock, Impl, device_type, host_view, is_tensor, pick_impl, torch_module
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
    out: Any = None,
    accumulate: bool = False,
    impl: Impl = "auto",
    scale: float = 1.0,
) -> Any:
    """Decode an EncodedBlock or a wire payload into a float32 tensor of ``numel`` elements.

    With ``out`` (a torch tensor, or a float32 numpy array) the result is written there (any
    shape with numel elements, contiguous) and ``out`` is returned; with ``accumulate=True`` it
    is added into ``out`` instead (the server's hot path). Without ``out``, a new torch tensor.
    A payload from the wire is fully validated (header, size, crc32, metadata, NaN/Inf) before
    anything is written, so a bad payload raises CodecError and leaves ``out`` untouched.

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
    if out is not None:
        _check_out(out, header.numel)
    impl = pick_impl(impl, device_type(out if out is not None else payload))
    if out is None:
        torch = torch_module()
        if header.non_finite:
            return torch.full((header.numel,), float("nan"), dtype=torch.float32,
                              device=payload.device if is_tensor(payload) else "cpu")
        if impl == "cuda":
            from . import cuda

            return cuda.decode(payload, header, None, accumulate)
        values = np.empty(header.numel, dtype=np.float32)
        _decode_cpu(_body(payload), header, values, False, impl)
        return torch.from_numpy(values)
    if header.non_finite:  # NaN + anything is NaN: accumulating or not, the result is NaN
        out.fill_(float("nan")) if is_tensor(out) else out.fill(np.nan)
        return out
    if impl == "cuda":
        from . import cuda

        cuda.decode(payload, header, out, accumulate)
        return _scaled(out, scale)
    if not is_tensor(out) or out.dtype == torch_module().float32:
        _decode_cpu(_body(payload), header, host_view(out).reshape(-1), accumulate, impl, scale)
        return out
    # decode in float32, then round once into the caller's dtype
    decoded = np.empty(header.numel, dtype=np.float32)
    _decode_cpu(_body(payload), header, decoded, False, impl)
    flat, values = out.view(-1), torch_module().from_numpy(decoded)
    flat.add_(values) if accumulate else flat.copy_(values)
    return _scaled(out, scale)


def _check_out(out: Any, numel: int) -> None:
    if is_tensor(out):
        size, contiguous, floating = out.numel(), out.is_contiguous(), out.is_floating_point()
    elif isinstance(out, np.ndarray):
        size, contiguous, floating = out.size, out.flags.c_contiguous, out.dtype == np.float32
    else:
        raise CodecError(f"out must be a torch tensor or a numpy array, got {type(out).__name__}")
    if size != numel:
        raise CodecError(f"out has {size} elements, the block holds {numel}")
    if not contiguous:
        raise CodecError("out must be contiguous")
    if not floating:
        raise CodecError(f"out must be a floating-point tensor (a numpy array: float32), got {out.dtype}")


def _body(payload: Any) -> np.ndarray:
    """A CPU payload's body (after the header) as uint8, without a copy."""
    if is_tensor(payload):
        payload = payload.cpu().numpy()
    return np.frombuffer(payload, dtype=np.uint8, offset=HEADER_SIZE)


def _scaled(out: Any, scale: float) -> Any:
    if scale != 1.0:
        if is_tensor(out):
            out.mul_(scale)
        else:
            np.multiply(out, np.float32(scale), out=out)
    return out


def _decode_cpu(body: np.ndarray, h: Header, out: np.ndarray, accumulate: bool, impl: str,
                scale: float = 1.0) -> None:
    """Decode into float32 ``out`` (flat), or add into it, times ``scale``."""
    if h.codec != Codec.MAXMIN:
        _store(out, _float_values(body, h), accumulate, scale)
        return
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
        from . import reference

        torch = torch_module()
        values = reference.decode_maxmin(torch.from_numpy(meta.copy()).view(-1, 2), torch.from_numpy(packed.copy()),
                                         h.numel, h.bits, h.bucket_size).numpy()
        _store(out, values, accumulate, scale)
        return
    cpu.decode_maxmin_into(meta, packed, out, accumulate, h.bits, h.bucket_size, scale)


def _store(out: np.ndarray, values: np.ndarray, accumulate: bool, scale: float) -> None:
    """``values`` written into ``out``, or added to it, then times ``scale`` (1 when accumulating:
    ``dequantize`` refuses the two together)."""
    if accumulate:
        np.add(out, values, out=out)
    else:
        out[:] = values
    _scaled(out, scale)


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
