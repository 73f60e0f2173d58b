"""CuPy kernels of the codecs for CUDA tensors: the same bytes as ``reference.py``, on the device.

Max-min uses three raw CUDA kernels, compiled by NVRTC on first use (never at import, so this
module imports without CuPy or a GPU). Each is one launch per buffer:

* ``maxmin_encode``: one bucket per segment of ``tpb`` threads (a power of two up to a whole
  block), a min/max reduction by warp shuffles (and shared memory across warps), then every
  thread quantizes groups of 8 consecutive elements, which fill exactly ``bits`` bytes, so each
  thread writes whole bytes and no atomics touch the packed stream;
  (A bucket never spans more than one block, so buckets far above 4096 elements leave most of
  a large GPU idle unless there are many of them; CGX uses 128 to 1024.)
* ``maxmin_check_meta``: validates every bucket's (min, unit) before a decode writes anything;
* ``maxmin_decode``: one thread per group of 8 elements, writing or adding float4s.

The kernels take the tensors' device pointers (checked first: ``check_encode_launch`` and
``check_decode_launch`` refuse, before any CuPy call, a size, dtype, layout or device that would
make a kernel write out of bounds) and run on torch's current stream, so they are ordered with
the caller's torch work; ``compile_kernels`` compiles them up front (a worker does at setup).
Their source is ``maxmin.cu`` beside this module; the checks and arguments of a launch are
``launch.py``.
Every float operation is an explicit round-to-nearest
intrinsic (and NVRTC runs with ``--fmad=false``): no FMA contraction, so the bytes equal the
reference's. FP32/FP16/BF16 are plain torch casts on the device.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from .. import wire
from ..errors import CodecError
from ..wire import HEADER_SIZE, Codec, Header
from .launch import BLOCK, check_decode_launch, check_encode_launch, decode_args, encode_args, threads_per_bucket

__all__ = [
    "CUDA_SOURCE",
    "KERNEL_NAMES",
    "NVRTC_OPTIONS",
    "compile_kernels",
    "decode",
    "decode_maxmin_async",
    "encode",
    "encode_maxmin_async",
    "to_host",
]

_MAX_GRID = 65535  # grid-stride loops cover the rest; more blocks would only add scheduling
Payload = Union[torch.Tensor, np.ndarray, bytes, bytearray, memoryview]
_FP_DTYPES = {Codec.FP32: torch.float32, Codec.FP16: torch.float16, Codec.BF16: torch.bfloat16}

KERNEL_NAMES = ("maxmin_encode", "maxmin_check_meta", "maxmin_decode")
NVRTC_OPTIONS = ("--fmad=false",)

CUDA_SOURCE = (Path(__file__).resolve().parent / "maxmin.cu").read_text()  # compiled on first use

_INSTALL_HINT = (
    "the CUDA codecs need CuPy: pip install 'cgx-ps[cuda12]' (CUDA 12.x) or "
    "'cgx-ps[cuda13]' (CUDA 13.x), matching your torch build"
)
_kernels: dict[str, Any] = {}
_kernels_lock = threading.Lock()
# Per codec thread: its CuPy stream wrappers and its status buffers, keyed by (device, torch
# stream), so a call allocates neither (a torch.full and a fresh ExternalStream cost more host
# time than a 4 MB block's kernel takes on a large GPU).
_per_thread = threading.local()


def _cupy() -> Any:
    """Import CuPy on first use, so importing this module never needs it."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return cupy


def _kernel(name: str) -> Any:
    # RawKernel compiles on its first launch and caches per device (and on disk by source hash).
    with _kernels_lock:
        if not _kernels:
            cp = _cupy()
            for k in KERNEL_NAMES:
                _kernels[k] = cp.RawKernel(CUDA_SOURCE, k, options=NVRTC_OPTIONS)
        return _kernels[name]


def compile_kernels(device: torch.device) -> None:
    """Compile every kernel for ``device`` now (NVRTC, or CuPy's on-disk cache), so that a
    toolkit, driver or source problem shows when a job is set up, not at its first gradient.
    Raises ImportError without CuPy, else whatever CuPy raises (``CompileException`` names the
    NVRTC log)."""
    cp = _cupy()
    with cp.cuda.Device(_index(device)):
        for name in KERNEL_NAMES:
            _kernel(name).compile()


def _grid(items: int, per_block: int) -> tuple[int]:
    return (max(1, min(_MAX_GRID, -(-items // per_block))),)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class _OnTorchStream:
    """CuPy device + torch's current stream for one device, as a context manager."""

    def __init__(self, cp: Any, index: int, stream_handle: int) -> None:
        self._device = cp.cuda.Device(index)
        self._stream = cp.cuda.ExternalStream(stream_handle, index)

    def __enter__(self) -> None:
        self._device.__enter__()
        self._stream.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)


class _ThreadState:
    """What one thread reuses across launches on one (device, stream)."""

    def __init__(self, cp: Any, device: torch.device, stream_handle: int) -> None:
        self.on_stream = _OnTorchStream(cp, _index(device), stream_handle)
        # [first NaN/Inf element, first overflowing bucket] of an encode, [first bad bucket] of a
        # metadata check: refilled with -1 before each launch, on the same stream, so a buffer
        # is never refilled while a kernel of this thread still writes it
        self.status = torch.empty(2, dtype=torch.int64, device=device)


def _thread_state(cp: Any, device: torch.device) -> _ThreadState:
    index = _index(device)
    handle = torch.cuda.current_stream(index).cuda_stream
    states = getattr(_per_thread, "states", None)
    if states is None:
        states = _per_thread.states = {}
    state = states.get((index, handle))
    if state is None:
        state = states[(index, handle)] = _ThreadState(cp, torch.device("cuda", index), handle)
    return state


# ---- encode ------------------------------------------------------------------------------------


def encode(x: torch.Tensor, header: Header, seed: int) -> torch.Tensor:
    """Encode float32 CUDA tensor ``x`` (1-D, contiguous) into a uint8 CUDA payload.

    The header's crc32 field is written as given (0): ``EncodedBlock.to_bytes`` fills it in.
    Raises CodecError on NaN/Inf (naming the first such element) or an overflowing bucket range.
    The payload is written by work queued on torch's current stream: read it on that stream
    (``to_host`` does), or make the reading stream wait for this one.
    """
    cp = _cupy() if header.codec == Codec.MAXMIN else None  # first: the likeliest setup error
    if x.device.type != "cuda" or x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise CodecError("cuda.encode needs a contiguous 1-D float32 CUDA tensor")
    payload = torch.empty(HEADER_SIZE + header.body_size, dtype=torch.uint8, device=x.device)
    _copy_from_host(np.frombuffer(wire.pack_header(header), dtype=np.uint8), payload[:HEADER_SIZE])
    if header.numel == 0:
        return payload
    if header.codec == Codec.MAXMIN:
        status = encode_maxmin_async(cp, x, payload, header, seed)
        bad, overflow = status.tolist()  # the one host sync of the call
        if bad >= 0:
            raise CodecError(f"gradient contains NaN/Inf (first at element {bad}: {float(x[bad])})")
        if overflow >= 0:
            raise CodecError(
                f"bucket {overflow}: max - min overflows float32; gradient out of range")
    else:
        _encode_float(x, payload[HEADER_SIZE:], header.codec)
    return payload


def encode_maxmin_async(cp: Any, x: torch.Tensor, payload: torch.Tensor, header: Header,
                        seed: int) -> torch.Tensor:
    """Launch ``maxmin_encode`` on torch's current stream; return the int64 status tensor
    (first NaN/Inf element, first overflowing bucket; -1 = none) without waiting for it.
    The status tensor is this thread's, reused: read it before the thread's next launch on the
    same stream. Raises CodecError (``check_encode_launch``) before touching the device."""
    check_encode_launch(x, payload, header)
    state = _thread_state(cp, x.device)
    status = state.status
    status.fill_(-1)
    nb = wire.num_buckets(header.numel, header.bucket_size)
    with state.on_stream:
        _kernel("maxmin_encode")(_grid(nb, BLOCK // threads_per_bucket(header.bucket_size)), (BLOCK,),
                                 encode_args(x, payload, header, seed, status))
    return status


def _encode_float(x: torch.Tensor, body: torch.Tensor, codec: Codec) -> None:
    y = x if codec == Codec.FP32 else x.to(_FP_DTYPES[codec])  # round to nearest even, as CPU
    if not bool(torch.isfinite(y).all()):  # one check covers both NaN/Inf input and overflow
        bad_x = ~torch.isfinite(x)
        if bool(bad_x.any()):
            bad = int(bad_x.nonzero()[0, 0])
            raise CodecError(f"tensor contains NaN/Inf (first at element {bad}: {float(x[bad])})")
        bad = int((~torch.isfinite(y)).nonzero()[0, 0])
        raise CodecError(f"element {bad} ({float(x[bad])}) overflows {codec.name.lower()}")
    # queued on the current stream after the function returns: the payload's reader must be
    # ordered after it (encode's docstring), as to_host on the same thread is
    body.copy_(y.view(torch.uint8))


def to_host(payload: torch.Tensor) -> np.ndarray:
    """A CUDA payload's bytes in host memory: copied on the current stream into pinned memory
    (DMA at full speed, where a pageable ``.cpu()`` goes through the driver's bounce buffers),
    waiting for that stream only. The array is the caller's (torch's host allocator keeps the
    pinned block until the array's tensor is freed)."""
    host = torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(payload.reshape(-1), non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(payload.device))
    done.synchronize()
    return host.numpy()


# ---- decode ------------------------------------------------------------------------------------


def decode(
    payload: Payload,
    header: Header,
    target: torch.Tensor | None,
    accumulate: bool,
) -> torch.Tensor:
    """Decode a payload (uint8 CUDA tensor, or host bytes / uint8 array copied to the device).

    Writes into (or with ``accumulate`` adds into) ``target`` (float32, float16 or bfloat16,
    contiguous, ``numel`` elements) and returns it, or returns a new float32 CUDA tensor.
    Everything is validated before ``target`` is touched: a bad payload raises CodecError and
    leaves it as it was.
    """
    if accumulate and target is None:
        raise CodecError("accumulate=True needs a target")
    cp = _cupy() if header.codec == Codec.MAXMIN else None
    if target is not None:
        device = target.device
    elif isinstance(payload, torch.Tensor) and payload.device.type == "cuda":
        device = payload.device
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        raise CodecError(f"cuda.decode needs a CUDA target, got one on {device}")
    pay = _on_device(payload, device)
    if pay.numel() != HEADER_SIZE + header.body_size:
        raise CodecError(f"payload has {pay.numel()} bytes, the header declares "
                         f"{HEADER_SIZE + header.body_size}")
    n = header.numel
    flat = target.view(-1) if target is not None else None
    direct = flat is not None and flat.dtype == torch.float32
    if header.codec != Codec.MAXMIN:
        values = _float_values(pay[HEADER_SIZE:], header)
        if flat is None:
            return values.to(torch.float32, copy=True)
        if accumulate:
            flat.add_(values)
        else:
            flat.copy_(values)
        return target
    out = flat if direct else torch.empty(n, dtype=torch.float32, device=device)
    if n:
        _check_meta(cp, pay, header)  # syncs; raises before anything is written
        decode_maxmin_async(cp, pay, header, out, accumulate and direct)
    if flat is None:
        return out
    if not direct:  # decoded in float32, now rounded once into the caller's dtype
        if accumulate:
            flat.add_(out)
        else:
            flat.copy_(out)
    return target


def decode_maxmin_async(cp: Any, payload: torch.Tensor, header: Header, out: torch.Tensor,
                        accumulate: bool) -> None:
    """Launch ``maxmin_decode`` into float32 ``out`` on torch's current stream, no host sync.
    The payload's metadata must be validated already (``decode`` does); its sizes, alignment
    and device are checked here (``check_decode_launch``) before the device is touched."""
    check_decode_launch(payload, header, out)
    state = _thread_state(cp, out.device)
    with state.on_stream:
        _kernel("maxmin_decode")(_grid(-(-header.numel // 8), BLOCK), (BLOCK,),
                                 decode_args(payload, header, out, accumulate))


def _check_meta(cp: Any, payload: torch.Tensor, header: Header) -> None:
    check_decode_launch(payload, header, None)
    nb = wire.num_buckets(header.numel, header.bucket_size)
    state = _thread_state(cp, payload.device)
    status = state.status[:1]
    status.fill_(-1)
    with state.on_stream:
        _kernel("maxmin_check_meta")(
            _grid(nb, BLOCK), (BLOCK,),
            (np.uint64(payload.data_ptr() + HEADER_SIZE), np.int64(nb), np.int32(header.bits),
             np.uint64(status.data_ptr())),
        )
    b = int(status.item())
    if b >= 0:
        mn, unit = payload[HEADER_SIZE + 8 * b: HEADER_SIZE + 8 * b + 8].cpu().numpy().view("<f4")
        raise CodecError(
            f"bucket {b} has invalid metadata (min={mn}, unit={unit}): corrupted payload?"
        )


def _float_values(body: torch.Tensor, header: Header) -> torch.Tensor:
    """The body of an FP32/FP16/BF16 payload viewed as its dtype, checked for NaN/Inf."""
    values = body.view(_FP_DTYPES[header.codec])
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        bad = int((~finite).nonzero()[0, 0])
        raise CodecError(f"payload contains NaN/Inf (first at element {bad})")
    return values


def _on_device(payload: Payload, device: torch.device) -> torch.Tensor:
    """The payload as a contiguous uint8 tensor on ``device``, 16-byte aligned so the kernels
    may use vector loads of the metadata and the packed levels."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8:
            raise CodecError(f"payload tensor must be uint8, got {payload.dtype}")
        pay = payload.reshape(-1).to(device)
    else:
        host = np.frombuffer(payload, dtype=np.uint8)
        pay = torch.empty(host.size, dtype=torch.uint8, device=device)
        _copy_from_host(host, pay)
    if not pay.is_contiguous() or pay.data_ptr() % 16:
        pay = pay.contiguous().clone()
    return pay


def _copy_from_host(host: np.ndarray, dst: torch.Tensor) -> None:
    """Copy host bytes into CUDA tensor ``dst`` on the current stream without blocking.

    Staging through pinned memory makes the copy asynchronous (the caller may free ``host`` at
    once; torch's host allocator keeps the staging block until the copy has run) and accepts
    read-only buffers such as ``bytes``, which torch cannot wrap without a warning.
    """
    if host.size:
        staged = torch.empty(host.size, dtype=torch.uint8, pin_memory=True)
        staged.numpy()[:] = host
        dst.copy_(staged, non_blocking=True)
