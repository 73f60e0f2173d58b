"""The numba loops of the CPU kernels (``cpu.py`` splits calls over threads and checks arguments).

A range kernel encodes, decodes or sums a range of buckets of levels of one bit width: the width
is a constant of the kernel (``encode_kernel(bits)``, ``decode_kernel(bits)``,
``sum_kernel(bits)`` build it on first use), so numba compiles only that width's loops (module
doc of ``cpu_packing``). Compiled cold, one width's three kernels take a few seconds on one core
where a kernel for every width took 25-35 s; ``warm.py`` starts what a job needs in the background.
numba caches each width's kernels on disk like any ``cache=True`` function: its index is keyed
by the closure's ``bits`` too.

Arithmetic is float32 in the reference's order with no fast-math contraction, so the bytes match
``reference.py`` exactly.
"""

from __future__ import annotations

import threading
from typing import Callable

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import rng
from .cpu_packing import pack, unpack

__all__ = ["decode_kernel", "encode_kernel", "first_bad_meta_kernel", "first_nonfinite_kernel", "sum_kernel"]

# Why the loops look the way they do (measured on AVX-512, 25M elements, one thread):
# - every hot loop runs over a slice from index 0: numba's negative-index wraparound check on
#   `x[start + i]` blocks LLVM's vectorizer (12-25 ms -> 3 ms for the scan below);
# - min/max is computed on integer keys of the float bits, which vectorizes without fast-math
#   (float min/max reductions did not), and the same pass spots NaN/Inf by their exponent;
# - stochastic rounding hashes in 32-bit lanes (_uniform24, as LLVM IR: numba widens uint32 products).


@numba.njit(inline="always")
def _mix32(x):
    # lowbias32 on uint32 (rng.py); numba widens products, the casts truncate back mod 2**32
    x ^= x >> np.uint32(16)
    x = np.uint32(x * np.uint32(rng.C1))
    x ^= x >> np.uint32(15)
    x = np.uint32(x * np.uint32(rng.C2))
    x ^= x >> np.uint32(16)
    return x


@intrinsic
def _uniform24(typingctx, base, i, key):
    """The stochastic rounding offset of element ``base + i`` (mod 2**32): lowbias32 of
    ``(base + i) ^ key``, top 24 bits, times 2**-24 (rng.py), all in 32-bit lanes. Written as
    LLVM IR because numba widens uint32 products to 64 bits, which AVX2 has no vector multiply
    for: the loop below stayed scalar (0.93 ms per 1M levels, 0.45 ms with this)."""
    sig = types.float32(types.uint32, types.int64, types.uint32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v = builder.xor(builder.add(args[0], builder.trunc(args[1], i32)), args[2])
        for shift, mult in ((16, rng.C1), (15, rng.C2)):
            v = builder.mul(builder.xor(v, builder.lshr(v, i32(shift))), i32(mult))
        v = builder.xor(v, builder.lshr(v, i32(16)))
        top24 = builder.sitofp(builder.lshr(v, i32(8)), ir.FloatType())  # < 2**24: exact
        return builder.fmul(top24, ir.Constant(ir.FloatType(), 2.0 ** -24))

    return sig, codegen


@numba.njit(inline="always")
def _scan(v):
    """(min, max, has_nonfinite) of a float32 bucket given as its int32 bit patterns."""
    lo = np.int32(0x7FFFFFFF)
    hi = np.int32(-0x80000000)
    exp = np.int32(0)
    for i in range(v.shape[0]):
        b = v[i]
        # Order-preserving map of float bits to signed ints (negative floats flip magnitude bits)
        k = b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))
        lo = min(lo, k)
        hi = max(hi, k)
        exp = max(exp, b & np.int32(0x7F800000))
    return _unkey(lo), _unkey(hi), exp == np.int32(0x7F800000)


@numba.njit(inline="always")
def _unkey(k):
    b = k ^ ((k >> np.int32(31)) & np.int32(0x7FFFFFFF))
    # +0.0 canonicalizes -0.0, as the reference does
    return _as_float32(b) + np.float32(0.0)


@intrinsic
def _as_float32(typingctx, bits):
    """The float32 whose bit pattern is the int32 ``bits`` (an LLVM bitcast: compiling numba's
    ``np.array([b]).view(np.float32)[0]`` instead cost a few tenths of a second per kernel)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@numba.njit(inline="always")
def _levels_nearest(xs, mn, scale, max_level, lv):
    half = np.float32(0.5)
    for i in range(xs.shape[0]):
        # x >= mn, so the argument is >= 0 and truncation equals floor
        lv[i] = np.uint8(min(np.int32((xs[i] - mn) * scale + half), max_level))


@numba.njit(inline="always")
def _levels_stochastic(xs, mn, scale, max_level, lv, base, key):
    b32 = np.uint32(base)
    for i in range(xs.shape[0]):
        r = _uniform24(b32, i, np.uint32(key))
        lv[i] = np.uint8(min(np.int32((xs[i] - mn) * scale + r), max_level))




@numba.njit(inline="always")
def _encode_bucket(xs, xbits, start, b, meta, packed, bits, stochastic, key, lv, status):
    """Encode bucket b (elements [start, start + len(xs)) of the tensor) into meta and packed,
    leaving its levels in lv; False (and status set, as encode_kernel says) if it cannot be."""
    end = start + xs.shape[0]
    max_level = np.int32((1 << bits) - 1)
    zero = np.float32(0.0)
    mn, mx, bad = _scan(xbits)
    if bad:
        status[0] = b
        return False
    unit = np.float32(mx - mn) / np.float32(max_level)
    if not np.isfinite(unit):
        status[1] = b
        return False
    scale = np.float32(1.0) / unit if unit > zero else zero
    if not np.isfinite(scale):  # a subnormal unit: encode like a constant bucket
        scale = zero
    meta[2 * b] = mn
    meta[2 * b + 1] = unit
    if not stochastic:
        _levels_nearest(xs, mn, scale, max_level, lv)
    else:
        # rng.py: h = mix(i_lo ^ s ^ mix(i_hi)); i_hi is constant within each 2**32 elements, so
        # a bucket straddling element 2**32 is done in two parts (one loop in the code: each
        # copy of it is a vectorized loop for LLVM to compile)
        lo = start
        while lo < end:
            hi = min(end, ((lo >> 32) + 1) << 32)
            k = np.uint32(key) ^ _mix32(np.uint32(lo >> 32))
            _levels_stochastic(xs[lo - start: hi - start], mn, scale, max_level, lv[lo - start: hi - start],
                               lo & 0xFFFFFFFF, k)
            lo = hi
    p0 = start * bits // 8
    pack(lv, packed[p0: p0 + ((end - start) * bits + 7) // 8], bits)
    return True



@numba.njit(inline="always")
def _copy(src, dst):
    # a loop, not `dst[:] = src`: numba compiles slice assignment's broadcasting machinery
    for j in range(src.shape[0]):
        dst[j] = src[j]


@numba.njit(inline="always")
def _scale(out, scale):
    for j in range(out.shape[0]):
        out[j] *= scale



@intrinsic
def _u8_at(typingctx, address):
    """A uint8 pointer to ``address``: the packed levels of a kept push, in a buffer that the
    caller of ``sum_maxmin_into`` holds and has checked the length of."""
    sig = types.CPointer(types.uint8)(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint8)))

    return sig, codegen



# ---- the range kernels, one per bit width --------------------------------------------------------
# Each closure holds nothing but the int ``bits``: numba keys its cache on the closure's contents,
# and would never find a closure over a compiled function again (those pickle with a fresh id).

_built: dict[tuple[str, int], Callable] = {}
_built_lock = threading.Lock()


def _kernel(kind: str, bits: int, make: Callable[[int], Callable]) -> Callable:
    """The kernel of this kind and width, built once per process (compiled on its first call)."""
    with _built_lock:
        kernel = _built.get((kind, bits))
        if kernel is None:
            kernel = _built[kind, bits] = make(bits)
        return kernel


def encode_kernel(bits: int) -> Callable:
    """``(x, xbits, meta, packed, bucket_size, stochastic, key, b0, b1, status)``: encode buckets
    [b0, b1). status[0] = first bucket holding NaN/Inf (or -1), status[1] = first bucket whose
    max - min overflows float32 (or -1)."""
    return _kernel("encode", bits, _make_encode)


def decode_kernel(bits: int) -> Callable:
    """``(meta, packed, out, accumulate, numel, bucket_size, scale, scaled, b0, b1, status)``:
    decode buckets [b0, b1) into out, or add into it. The caller has validated meta. With
    ``scaled`` (not accumulating), multiply each bucket by the float32 ``scale`` while it is
    still in L1: the products torch's ``out.mul_(scale)`` makes, without a second pass over out."""
    return _kernel("decode", bits, _make_decode)


def sum_kernel(bits: int) -> Callable:
    """``(levels_at, metas, count, numel, bucket_size, acc, from_acc, encode, residual, feedback,
    meta, packed, stochastic, key, b0, b1, status)``: sum buckets [b0, b1) of the first ``count``
    encoded pushes (in arrival order; push k's (min, unit) pairs are metas[k, :2 * buckets], its
    packed levels start at address levels_at[k]), after acc if from_acc. Each bucket is summed in
    a scratch buffer that stays in L1, with exactly the additions of decoding into an accumulator
    one push at a time. Then either store the bucket's sum into acc (encode False), or encode it
    into meta and packed (the bucket code of the encoding kernel; with feedback, the residual is
    added first and replaced by what the encoding left out, as encode_with_feedback does)."""
    return _kernel("sum", bits, _make_sum)


def _make_encode(bits: int) -> Callable:
    @numba.njit(nogil=True, cache=True)
    def encode_range(x, xbits, meta, packed, bucket_size, stochastic, key, b0, b1, status):
        n = x.shape[0]
        lv_buf = np.empty(bucket_size, dtype=np.uint8)
        for b in range(b0, b1):
            start = b * bucket_size
            end = min(start + bucket_size, n)
            if not _encode_bucket(x[start:end], xbits[start:end], start, b, meta, packed, bits, stochastic, key,
                                  lv_buf[: end - start], status):
                return

    return encode_range


def _make_decode(bits: int) -> Callable:
    @numba.njit(nogil=True, cache=True)
    def decode_range(meta, packed, out, accumulate, numel, bucket_size, scale, scaled, b0, b1, status):
        lv_buf = np.empty(bucket_size, dtype=np.uint8)
        for b in range(b0, b1):
            start = b * bucket_size
            end = min(start + bucket_size, numel)
            p0 = start * bits // 8
            src = packed[p0: p0 + ((end - start) * bits + 7) // 8]
            unpack(src, out[start:end], meta[2 * b], meta[2 * b + 1], bits, accumulate, lv_buf)
            if scaled:
                _scale(out[start:end], scale)

    return decode_range


def _make_sum(bits: int) -> Callable:
    @numba.njit(nogil=True, cache=True)
    def sum_range(levels_at, metas, count, numel, bucket_size, acc, from_acc, encode, residual, feedback,
                  meta, packed, stochastic, key, b0, b1, status):
        x = np.empty(bucket_size, dtype=np.float32)
        lv_buf = np.empty(bucket_size, dtype=np.uint8)
        for b in range(b0, b1):
            start = b * bucket_size
            end = min(start + bucket_size, numel)
            xs = x[: end - start]
            p0 = start * bits // 8
            nbytes = ((end - start) * bits + 7) // 8
            if from_acc:
                _copy(acc[start:end], xs)
            for k in range(count):
                # the first push is decoded into the scratch (no partial sum), the others added
                src = numba.carray(_u8_at(levels_at[k] + np.uint64(p0)), (nbytes,))
                unpack(src, xs, metas[k, 2 * b], metas[k, 2 * b + 1], bits, from_acc or k > 0, lv_buf)
            if not encode:
                _copy(xs, acc[start:end])
                continue
            if feedback:
                r = residual[start:end]
                for j in range(xs.shape[0]):
                    xs[j] += r[j]
            lv = lv_buf[: end - start]
            if not _encode_bucket(xs, xs.view(np.int32), start, b, meta, packed, bits, stochastic, key, lv, status):
                return
            if feedback:
                # residual = sum - decode(encoded), as dequantize(out=residual); neg_(); add_(sum)
                mn, unit = meta[2 * b], meta[2 * b + 1]
                for j in range(xs.shape[0]):
                    r[j] = xs[j] - (mn + unit * np.float32(lv[j]))

    return sum_range


# ---- validation scans, one kernel for every width ------------------------------------------------

@numba.njit(nogil=True, cache=True)
def first_nonfinite_kernel(v, exp_mask):
    """Index of the first NaN/Inf in an array of IEEE float bit patterns (int16 or int32) whose
    exponent field is exp_mask, or -1. Vectorized max over exponents, then a scalar search."""
    chunk = 1 << 16
    for c in range(0, v.shape[0], chunk):
        part = v[c: c + chunk]
        e = part[0] & exp_mask
        for i in range(part.shape[0]):
            e = max(e, part[i] & exp_mask)
        if e == exp_mask:
            for i in range(part.shape[0]):
                if (part[i] & exp_mask) == exp_mask:
                    return c + i
    return -1


@numba.njit(nogil=True, cache=True)
def first_bad_meta_kernel(meta, top_level):
    for b in range(meta.shape[0] // 2):
        mn = meta[2 * b]
        unit = meta[2 * b + 1]
        top = mn + unit * top_level  # float32, as decoding's top level is
        if not (np.isfinite(mn) and np.isfinite(unit) and unit >= np.float32(0.0) and np.isfinite(top)):
            return b
    return -1

