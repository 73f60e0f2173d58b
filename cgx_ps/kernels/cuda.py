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
Every float operation is an explicit round-to-nearest
intrinsic (and NVRTC runs with ``--fmad=false``): no FMA contraction, so the bytes equal the
reference's. FP32/FP16/BF16 are plain torch casts on the device.
"""

from __future__ import annotations

import threading
from typing import Any, Union

import numpy as np
import torch

from . import rng, wire
from .errors import CodecError
from .wire import HEADER_SIZE, Codec, Header

__all__ = [
    "BLOCK",
    "CUDA_SOURCE",
    "KERNEL_NAMES",
    "NVRTC_OPTIONS",
    "check_decode_launch",
    "check_encode_launch",
    "compile_kernels",
    "decode",
    "decode_args",
    "decode_maxmin_async",
    "encode",
    "encode_args",
    "encode_maxmin_async",
    "threads_per_bucket",
    "to_host",
]

BLOCK = 256  # threads per block of every kernel (BLOCK in the source)
_MAX_GRID = 65535  # grid-stride loops cover the rest; more blocks would only add scheduling
Payload = Union[torch.Tensor, np.ndarray, bytes, bytearray, memoryview]
_FP_DTYPES = {Codec.FP32: torch.float32, Codec.FP16: torch.float16, Codec.BF16: torch.bfloat16}

KERNEL_NAMES = ("maxmin_encode", "maxmin_check_meta", "maxmin_decode")
NVRTC_OPTIONS = ("--fmad=false",)

CUDA_SOURCE = r"""
// Max-min codec kernels of cgx_ps/kernels/cuda.py; the definition is reference.py.
#define BLOCK 256
#define CACHED 2  // groups of 8 a thread keeps in registers between the min/max and the level pass

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ bool nonfinite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}

// lowbias32, as rng.py
__device__ __forceinline__ u32 mix32(u32 x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

// Load the group of 8 elements at x[i], of which m (1..8) exist; missing lanes repeat v[0],
// which changes neither the group's min nor its max.
__device__ __forceinline__ void load8(const float* __restrict__ x, long long i, int m, bool vec,
                                      float v[8]) {
    if (m == 8 && vec) {  // i is a multiple of 8, so both float4s are 16-byte aligned
        const float4 a = __ldg(reinterpret_cast<const float4*>(x + i));
        const float4 b = __ldg(reinterpret_cast<const float4*>(x + i) + 1);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __ldg(x + i + (k < m ? k : 0));
    }
}

__device__ __forceinline__ void scan8(const float v[8], long long i, float& mn, float& mx,
                                      u64& first_bad) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        mn = fminf(mn, v[k]);
        mx = fmaxf(mx, v[k]);
        if (nonfinite(v[k]) && (u64)(i + k) < first_bad) first_bad = (u64)(i + k);
    }
}

// Levels of m (1..8) elements starting at global index i, packed LSB-first into a u64:
// level = clamp(floor((x - mn) * scale + r), 0, max_level), one rounding per operation.
__device__ __forceinline__ u64 quantize8(const float v[8], long long i, int m, float mn,
                                         float scale, float max_level, int bits, int stochastic,
                                         u32 key) {
    // rng.py: h(i) = mix(i_lo ^ s ^ mix(i_hi)); a group never straddles 2**32, so i_hi is fixed
    const u32 k_hi = key ^ mix32((u32)((u64)i >> 32));
    u64 out = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (k < m) {
            float r = 0.5f;
            if (stochastic) {
                const u32 h = mix32(((u32)(u64)i + (u32)k) ^ k_hi);
                r = __fmul_rn(__uint2float_rn(h >> 8), 5.9604644775390625e-08f);  // 2**-24
            }
            float t = floorf(__fadd_rn(__fmul_rn(__fsub_rn(v[k], mn), scale), r));
            // fmaxf maps NaN (0 * inf, a subnormal unit) to 0 like the reference; inf clamps
            t = fminf(fmaxf(t, 0.0f), max_level);
            out |= (u64)(u32)t << (k * bits);
        }
    }
    return out;
}

// `nbytes` bytes of v at p (p = packed + 8-aligned base + group * bits): one aligned store when
// bits is 1, 2, 4 or 8 and the group is whole, else single bytes.
__device__ __forceinline__ void store_bytes(unsigned char* p, u64 v, int nbytes, int bits) {
    if (nbytes == bits) {
        switch (bits) {
            case 1: *p = (unsigned char)v; return;
            case 2: *reinterpret_cast<unsigned short*>(p) = (unsigned short)v; return;
            case 4: *reinterpret_cast<u32*>(p) = (u32)v; return;
            case 8: *reinterpret_cast<u64*>(p) = v; return;
        }
    }
    for (int j = 0; j < nbytes; ++j) p[j] = (unsigned char)(v >> (8 * j));
}

__device__ __forceinline__ u64 load_bytes(const unsigned char* p, int nbytes, int bits) {
    if (nbytes == bits) {
        switch (bits) {
            case 1: return *p;
            case 2: return *reinterpret_cast<const unsigned short*>(p);
            case 4: return *reinterpret_cast<const u32*>(p);
            case 8: return *reinterpret_cast<const u64*>(p);
        }
    }
    u64 v = 0;
    for (int j = 0; j < nbytes; ++j) v |= (u64)p[j] << (8 * j);
    return v;
}

// status[0]: lowest index of a NaN/Inf element, status[1]: lowest bucket whose max - min
// overflows; both start at ~0 (-1 as int64) and only ever decrease (atomicMin).
extern "C" __global__ void __launch_bounds__(BLOCK)
maxmin_encode(const float* __restrict__ x, long long n, int bucket_size, int bits, int tpb,
              int stochastic, u32 key, float* __restrict__ meta,
              unsigned char* __restrict__ packed, u64* __restrict__ status) {
    __shared__ float s_mn[BLOCK / 32], s_mx[BLOCK / 32];
    const int seg = threadIdx.x / tpb;   // which bucket of the block's batch
    const int lane = threadIdx.x % tpb;  // thread within that bucket
    const int per_block = BLOCK / tpb;
    const int width = tpb < 32 ? tpb : 32;
    const float max_level = (float)((1 << bits) - 1);
    const float inf = __int_as_float(0x7f800000);
    const bool vec = ((u64)x & 15) == 0;
    const long long nb = (n + bucket_size - 1) / bucket_size;
    u64 first_bad = ~0ull;

    // Block-uniform loop: every thread runs every iteration, so shuffles and barriers are safe.
    for (long long base = (long long)blockIdx.x * per_block; base < nb;
         base += (long long)gridDim.x * per_block) {
        const long long b = base + seg;
        const long long start = b * bucket_size;
        const long long rest = n - start;
        const int m = b < nb ? (rest < bucket_size ? (int)rest : bucket_size) : 0;
        const int groups = (m + 7) / 8;
        float v[CACHED][8];
        float mn = inf, mx = -inf;

#pragma unroll
        for (int c = 0; c < CACHED; ++c) {
            const int g = lane + c * tpb;
            if (g < groups) {
                const int gm = m - 8 * g < 8 ? m - 8 * g : 8;
                load8(x, start + 8 * g, gm, vec, v[c]);
                scan8(v[c], start + 8 * g, mn, mx, first_bad);
            }
        }
        for (int g = lane + CACHED * tpb; g < groups; g += tpb) {  // buckets over 4096 elements
            float w[8];
            const int gm = m - 8 * g < 8 ? m - 8 * g : 8;
            load8(x, start + 8 * g, gm, vec, w);
            scan8(w, start + 8 * g, mn, mx, first_bad);
        }

        // Reduce over the bucket's threads: xor offsets below `width` stay inside the segment.
        for (int off = width >> 1; off > 0; off >>= 1) {
            mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        }
        if (tpb > 32) {  // several warps per bucket: combine their partials in shared memory
            if ((threadIdx.x & 31) == 0) {
                s_mn[threadIdx.x >> 5] = mn;
                s_mx[threadIdx.x >> 5] = mx;
            }
            __syncthreads();
            const int first = seg * (tpb >> 5);
            mn = s_mn[first];
            mx = s_mx[first];
            for (int w = 1; w < (tpb >> 5); ++w) {
                mn = fminf(mn, s_mn[first + w]);
                mx = fmaxf(mx, s_mx[first + w]);
            }
            __syncthreads();  // s_mn/s_mx are rewritten by the next batch
        }
        // "+ 0" turns a -0.0 extreme into +0.0, as the reference does
        mn = __fadd_rn(mn, 0.0f);
        mx = __fadd_rn(mx, 0.0f);
        const float unit = __fdiv_rn(__fsub_rn(mx, mn), max_level);
        // 1/unit overflows for a subnormal unit: such a bucket encodes like a constant one.
        float scale = unit > 0.0f ? __frcp_rn(unit) : 0.0f;
        if (isinf(scale)) scale = 0.0f;
        if (m > 0 && lane == 0) {
            *reinterpret_cast<float2*>(meta + 2 * b) = make_float2(mn, unit);
            if (nonfinite(unit)) atomicMin(status + 1, (u64)b);
        }

#pragma unroll
        for (int c = 0; c < CACHED; ++c) {
            const int g = lane + c * tpb;
            if (g < groups) {
                const int gm = m - 8 * g < 8 ? m - 8 * g : 8;
                const long long gi = start / 8 + g;  // global group index
                const u64 lv = quantize8(v[c], 8 * gi, gm, mn, scale, max_level, bits,
                                         stochastic, key);
                store_bytes(packed + gi * bits, lv, (gm * bits + 7) / 8, bits);
            }
        }
        for (int g = lane + CACHED * tpb; g < groups; g += tpb) {  // reloads hit L1/L2
            float w[8];
            const int gm = m - 8 * g < 8 ? m - 8 * g : 8;
            const long long gi = start / 8 + g;
            load8(x, 8 * gi, gm, vec, w);
            const u64 lv = quantize8(w, 8 * gi, gm, mn, scale, max_level, bits, stochastic, key);
            store_bytes(packed + gi * bits, lv, (gm * bits + 7) / 8, bits);
        }
    }
    if (first_bad != ~0ull) atomicMin(status, first_bad);
}

// status[0]: lowest bucket whose metadata is invalid (non-finite min or unit, unit < 0, or
// min + unit * max_level not finite), starting at ~0.
extern "C" __global__ void __launch_bounds__(BLOCK)
maxmin_check_meta(const float2* __restrict__ meta, long long nb, int bits,
                  u64* __restrict__ status) {
    const float max_level = (float)((1 << bits) - 1);
    for (long long b = (long long)blockIdx.x * BLOCK + threadIdx.x; b < nb;
         b += (long long)gridDim.x * BLOCK) {
        const float2 mu = meta[b];
        const float top = __fadd_rn(mu.x, __fmul_rn(mu.y, max_level));
        if (nonfinite(mu.x) || nonfinite(mu.y) || !(mu.y >= 0.0f) || nonfinite(top))
            atomicMin(status, (u64)b);
    }
}

// out[i] = min + unit * level (two roundings), or out[i] += that; meta already validated.
extern "C" __global__ void __launch_bounds__(BLOCK)
maxmin_decode(const float2* __restrict__ meta, const unsigned char* __restrict__ packed,
              long long n, int bucket_size, int bits, int accumulate, float* __restrict__ out) {
    const long long groups = (n + 7) / 8;
    const long long groups_per_bucket = bucket_size / 8;
    const u32 mask = (1u << bits) - 1u;
    const bool vec = ((u64)out & 15) == 0;
    for (long long g = (long long)blockIdx.x * BLOCK + threadIdx.x; g < groups;
         g += (long long)gridDim.x * BLOCK) {
        const long long i = 8 * g;
        const int m = n - i < 8 ? (int)(n - i) : 8;
        const float2 mu = meta[g / groups_per_bucket];
        const u64 lv = load_bytes(packed + g * bits, (m * bits + 7) / 8, bits);
        float y[8];
#pragma unroll
        for (int k = 0; k < 8; ++k)
            y[k] = __fadd_rn(mu.x, __fmul_rn(mu.y, (float)((u32)(lv >> (k * bits)) & mask)));
        if (m == 8 && vec) {
            float4* o = reinterpret_cast<float4*>(out + i);
            float4 a = make_float4(y[0], y[1], y[2], y[3]);
            float4 c = make_float4(y[4], y[5], y[6], y[7]);
            if (accumulate) {
                const float4 p = o[0], q = o[1];
                a = make_float4(__fadd_rn(p.x, a.x), __fadd_rn(p.y, a.y),
                                __fadd_rn(p.z, a.z), __fadd_rn(p.w, a.w));
                c = make_float4(__fadd_rn(q.x, c.x), __fadd_rn(q.y, c.y),
                                __fadd_rn(q.z, c.z), __fadd_rn(q.w, c.w));
            }
            o[0] = a;
            o[1] = c;
        } else {
#pragma unroll  // constant indices keep y[] in registers
            for (int k = 0; k < 8; ++k)
                if (k < m) out[i + k] = accumulate ? __fadd_rn(out[i + k], y[k]) : y[k];
        }
    }
}
"""

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
