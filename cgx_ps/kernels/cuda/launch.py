"""What a launch of the CUDA codec kernels (codec.py, maxmin.cu) may be given, and how it is
given: the checks run before any CuPy call, so that a bad call never writes out of bounds, and
the kernels' arguments are device pointers and sizes (no DLPack import per call). Pure
functions of tensors' shapes, dtypes, pointers and devices, and of a block's header: they run
and are tested without a GPU where they can be.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import rng, wire
from ..errors import CodecError
from ..wire import HEADER_SIZE, Codec, Header

__all__ = ["BLOCK", "check_decode_launch", "check_encode_launch", "decode_args", "encode_args",
           "threads_per_bucket"]

BLOCK = 256  # threads per block of every kernel (BLOCK in maxmin.cu)


# ---- launch checks: before any CuPy call, so that a bad call never writes out of bounds ---------


def check_encode_launch(x: torch.Tensor, payload: torch.Tensor, header: Header) -> None:
    """Raise CodecError unless ``maxmin_encode`` may run for ``header`` from ``x`` into
    ``payload``: a max-min header with valid settings, ``x`` contiguous float32 of ``numel``
    elements, ``payload`` contiguous uint8 of exactly header + body bytes, 16-byte aligned (the
    kernel stores the metadata as float2 and whole groups as up to 8-byte words), both on one
    CUDA device. Reads only shapes, dtypes, pointers and devices."""
    _check_maxmin_header(header, "maxmin_encode")
    _check_flat(x, "input", torch.float32, header.numel, "maxmin_encode")
    _check_flat(payload, "payload", torch.uint8, HEADER_SIZE + header.body_size, "maxmin_encode")
    _check_aligned(payload, "maxmin_encode")
    _check_one_cuda_device("maxmin_encode", input=x, payload=payload)


def check_decode_launch(payload: torch.Tensor, header: Header, out: torch.Tensor | None) -> None:
    """Raise CodecError unless ``maxmin_decode`` (``out`` given) or ``maxmin_check_meta`` (None)
    may read ``payload`` for ``header`` and write ``out``: a max-min header with valid settings,
    ``payload`` contiguous uint8 of exactly header + body bytes and 16-byte aligned, ``out``
    contiguous float32 of ``numel`` elements, all on one CUDA device."""
    entry = "maxmin_decode" if out is not None else "maxmin_check_meta"
    _check_maxmin_header(header, entry)
    _check_flat(payload, "payload", torch.uint8, HEADER_SIZE + header.body_size, entry)
    _check_aligned(payload, entry)
    if out is None:
        _check_one_cuda_device(entry, payload=payload)
        return
    _check_flat(out, "output", torch.float32, header.numel, entry)
    _check_one_cuda_device(entry, payload=payload, output=out)


def _check_maxmin_header(header: Header, entry: str) -> None:
    if header.codec != Codec.MAXMIN:
        raise CodecError(f"{entry}: header codec is {header.codec.name}, expected MAXMIN")
    if header.non_finite:  # its body_size is 0 whatever numel says: the kernels would run past it
        raise CodecError(f"{entry}: header has the non-finite flag, expected a block with a body")
    wire.validate_settings(header.codec, header.bits, header.bucket_size)
    if header.numel < 0:
        raise CodecError(f"{entry}: header numel is {header.numel}, expected >= 0")


def _check_flat(t: torch.Tensor, name: str, dtype: torch.dtype, numel: int, entry: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"{entry}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise CodecError(f"{entry}: {name} dtype is {t.dtype}, expected {dtype}")
    if t.numel() != numel:
        raise CodecError(f"{entry}: {name} has {t.numel()} elements, the header needs exactly {numel}")
    if not t.is_contiguous():
        raise CodecError(f"{entry}: {name} must be contiguous")


def _check_aligned(payload: torch.Tensor, entry: str) -> None:
    if payload.data_ptr() % 16:
        raise CodecError(f"{entry}: payload address {payload.data_ptr():#x} is not 16-byte aligned")


def _check_one_cuda_device(entry: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    for name, device in devices.items():
        if device.type != "cuda":
            raise CodecError(f"{entry}: {name} is on {device}, expected a CUDA device")
    if len(set(devices.values())) > 1:
        found = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise CodecError(f"{entry}: tensors on different devices ({found})")


# ---- kernel arguments: device pointers and sizes, no DLPack import per call ----------------------


def encode_args(x: torch.Tensor, payload: torch.Tensor, header: Header, seed: int,
                status: torch.Tensor) -> tuple:
    """``maxmin_encode``'s arguments, in the order of its signature (pointers as uint64)."""
    n, bucket_size, bits = header.numel, header.bucket_size, header.bits
    nb = wire.num_buckets(n, bucket_size)
    meta = payload.data_ptr() + HEADER_SIZE
    key = rng.seed_key(seed) if header.stochastic else 0
    return (np.uint64(x.data_ptr()), np.int64(n), np.int32(bucket_size), np.int32(bits),
            np.int32(threads_per_bucket(bucket_size)), np.int32(header.stochastic), np.uint32(key),
            np.uint64(meta), np.uint64(meta + 8 * nb), np.uint64(status.data_ptr()))


def decode_args(payload: torch.Tensor, header: Header, out: torch.Tensor, accumulate: bool) -> tuple:
    """``maxmin_decode``'s arguments, in the order of its signature (pointers as uint64)."""
    nb = wire.num_buckets(header.numel, header.bucket_size)
    meta = payload.data_ptr() + HEADER_SIZE
    return (np.uint64(meta), np.uint64(meta + 8 * nb), np.int64(header.numel),
            np.int32(header.bucket_size), np.int32(header.bits), np.int32(accumulate),
            np.uint64(out.data_ptr()))


def threads_per_bucket(bucket_size: int) -> int:
    """One thread per group of 8 elements, as a power of two up to a whole block."""
    return min(BLOCK, 1 << max(0, (bucket_size // 8 - 1).bit_length()))
