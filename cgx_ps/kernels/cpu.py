"""Fused, multithreaded CPU kernels of the max-min codec (numba, GIL released).

One pass reads each input element once for min/max and once for the levels (the bucket is still
in L1/L2), and writes packed bytes directly: no intermediate tensors. Buckets are independent, so
a call is split into contiguous bucket ranges that run on a small thread pool; every kernel is
compiled with ``nogil=True`` so these threads (and a server's own executor threads) run truly in
parallel. We avoid numba's ``parallel=True``: its default threading layer aborts when two Python
threads launch parallel kernels at once, which is exactly what a server does.

Arithmetic is float32 in the reference's order with no fast-math contraction, so the bytes match
``reference.py`` exactly.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import rng

__all__ = ["encode_maxmin_into", "decode_maxmin_into", "sum_maxmin_into", "first_bad_meta", "first_nonfinite",
           "num_threads", "set_num_threads"]

_MIN_BUCKETS_PER_THREAD = 64  # below ~64K elements a thread hop costs more than it saves

# Why the loops look the way they do (measured on AVX-512, 25M elements, one thread):
# - every hot loop runs over a slice from index 0: numba's negative-index wraparound check on
#   `x[start + i]` blocks LLVM's vectorizer (12-25 ms -> 3 ms for the scan below);
# - min/max is computed on integer keys of the float bits, which vectorizes without fast-math
#   (float min/max reductions did not), and the same pass spots NaN/Inf by their exponent;
# - stochastic rounding hashes in 32-bit lanes (_uniform24, as LLVM IR: numba widens uint32 products);
# - (un)packing has one straight-line loop per bit width with constant shifts: 8 levels of b bits
#   are b whole bytes. A loop over a runtime `bits` did not vectorize (3-bit: 4x slower).


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
    return np.array([b], dtype=np.int32).view(np.float32)[0] + np.float32(0.0)


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
def _pack(lv, out, bits):
    """Pack levels LSB-first into out (exactly ceil(len(lv) * bits / 8) bytes)."""
    m = lv.shape[0]
    if bits == 8:
        for j in range(m):
            out[j] = lv[j]
    elif bits == 4:
        for j in range(m // 2):
            out[j] = lv[2 * j] | (lv[2 * j + 1] << np.uint8(4))
        if m % 2:
            out[m // 2] = lv[m - 1]
    elif bits == 2:
        for j in range(m // 4):
            out[j] = (lv[4 * j] | (lv[4 * j + 1] << np.uint8(2)) | (lv[4 * j + 2] << np.uint8(4))
                      | (lv[4 * j + 3] << np.uint8(6)))
        _pack_tail(lv, out, bits, (m // 4) * 4)
    elif bits == 1:
        for j in range(m // 8):
            v = np.uint8(0)
            for k in range(8):
                v |= lv[8 * j + k] << np.uint8(k)
            out[j] = v
        _pack_tail(lv, out, bits, (m // 8) * 8)
    else:
        # 3, 5, 6, 7 bits: whole 8-level groups, then the partial group of a bucket's tail
        if bits == 3:
            _pack3(lv, out)
        elif bits == 5:
            _pack5(lv, out)
        elif bits == 6:
            _pack6(lv, out)
        else:
            _pack7(lv, out)
        _pack_tail(lv, out, bits, (m // 8) * 8)


@numba.njit(inline="always")
def _pack_tail(lv, out, bits, first):
    """Pack levels [first, m) (fewer than one 8-level group) into their bytes."""
    m = lv.shape[0]
    if first == m:
        return
    v = np.uint64(0)
    for k in range(m - first):
        v |= np.uint64(lv[first + k]) << np.uint64(k * bits)
    p = first * bits // 8
    for j in range(((m - first) * bits + 7) // 8):
        out[p + j] = np.uint8((v >> np.uint64(8 * j)) & np.uint64(0xFF))


# Level k of an 8-level group sits at bits [k * bits, (k + 1) * bits) of the group's `bits`
# bytes (LSB-first); a level crossing a byte boundary is split between two bytes. uint8 shifts
# widen in numba, and storing into a uint8 array drops the bits that spill into the next byte.


@numba.njit(inline="always")
def _pack3(lv, out):
    for g in range(lv.shape[0] // 8):
        out[3 * g] = lv[8 * g] | (lv[8 * g + 1] << np.uint8(3)) | (lv[8 * g + 2] << np.uint8(6))
        out[3 * g + 1] = ((lv[8 * g + 2] >> np.uint8(2)) | (lv[8 * g + 3] << np.uint8(1))
                          | (lv[8 * g + 4] << np.uint8(4)) | (lv[8 * g + 5] << np.uint8(7)))
        out[3 * g + 2] = ((lv[8 * g + 5] >> np.uint8(1))
                          | (lv[8 * g + 6] << np.uint8(2)) | (lv[8 * g + 7] << np.uint8(5)))


@numba.njit(inline="always")
def _pack5(lv, out):
    for g in range(lv.shape[0] // 8):
        out[5 * g] = lv[8 * g] | (lv[8 * g + 1] << np.uint8(5))
        out[5 * g + 1] = ((lv[8 * g + 1] >> np.uint8(3))
                          | (lv[8 * g + 2] << np.uint8(2)) | (lv[8 * g + 3] << np.uint8(7)))
        out[5 * g + 2] = (lv[8 * g + 3] >> np.uint8(1)) | (lv[8 * g + 4] << np.uint8(4))
        out[5 * g + 3] = ((lv[8 * g + 4] >> np.uint8(4))
                          | (lv[8 * g + 5] << np.uint8(1)) | (lv[8 * g + 6] << np.uint8(6)))
        out[5 * g + 4] = (lv[8 * g + 6] >> np.uint8(2)) | (lv[8 * g + 7] << np.uint8(3))


@numba.njit(inline="always")
def _pack6(lv, out):
    for g in range(lv.shape[0] // 8):
        out[6 * g] = lv[8 * g] | (lv[8 * g + 1] << np.uint8(6))
        out[6 * g + 1] = (lv[8 * g + 1] >> np.uint8(2)) | (lv[8 * g + 2] << np.uint8(4))
        out[6 * g + 2] = (lv[8 * g + 2] >> np.uint8(4)) | (lv[8 * g + 3] << np.uint8(2))
        out[6 * g + 3] = lv[8 * g + 4] | (lv[8 * g + 5] << np.uint8(6))
        out[6 * g + 4] = (lv[8 * g + 5] >> np.uint8(2)) | (lv[8 * g + 6] << np.uint8(4))
        out[6 * g + 5] = (lv[8 * g + 6] >> np.uint8(4)) | (lv[8 * g + 7] << np.uint8(2))


@numba.njit(inline="always")
def _pack7(lv, out):
    for g in range(lv.shape[0] // 8):
        out[7 * g] = lv[8 * g] | (lv[8 * g + 1] << np.uint8(7))
        out[7 * g + 1] = (lv[8 * g + 1] >> np.uint8(1)) | (lv[8 * g + 2] << np.uint8(6))
        out[7 * g + 2] = (lv[8 * g + 2] >> np.uint8(2)) | (lv[8 * g + 3] << np.uint8(5))
        out[7 * g + 3] = (lv[8 * g + 3] >> np.uint8(3)) | (lv[8 * g + 4] << np.uint8(4))
        out[7 * g + 4] = (lv[8 * g + 4] >> np.uint8(4)) | (lv[8 * g + 5] << np.uint8(3))
        out[7 * g + 5] = (lv[8 * g + 5] >> np.uint8(5)) | (lv[8 * g + 6] << np.uint8(2))
        out[7 * g + 6] = (lv[8 * g + 6] >> np.uint8(6)) | (lv[8 * g + 7] << np.uint8(1))


@numba.njit(nogil=True, cache=True)
def _encode_range(x, xbits, meta, packed, bits, bucket_size, stochastic, key, b0, b1, status):
    """Encode buckets [b0, b1). status[0] = first bucket holding NaN/Inf (or -1),
    status[1] = first bucket whose max - min overflows float32 (or -1)."""
    n = x.shape[0]
    lv_buf = np.empty(bucket_size, dtype=np.uint8)
    for b in range(b0, b1):
        start = b * bucket_size
        end = min(start + bucket_size, n)
        if not _encode_bucket(x[start:end], xbits[start:end], start, b, meta, packed, bits, stochastic, key,
                              lv_buf[: end - start], status):
            return


@numba.njit(inline="always")
def _encode_bucket(xs, xbits, start, b, meta, packed, bits, stochastic, key, lv, status):
    """Encode bucket b (elements [start, start + len(xs)) of the tensor) into meta and packed,
    leaving its levels in lv; False (and status set, as _encode_range says) if it cannot be."""
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
    elif (start >> 32) == ((end - 1) >> 32):
        # rng.py: h = mix(i_lo ^ s ^ mix(i_hi)); i_hi is constant across this bucket
        k = np.uint32(key) ^ _mix32(np.uint32(start >> 32))
        _levels_stochastic(xs, mn, scale, max_level, lv, start & 0xFFFFFFFF, k)
    else:  # a bucket straddling element 2**32: split it there
        cut = ((start >> 32) + 1) << 32
        k0 = np.uint32(key) ^ _mix32(np.uint32(start >> 32))
        k1 = np.uint32(key) ^ _mix32(np.uint32(cut >> 32))
        _levels_stochastic(xs[: cut - start], mn, scale, max_level, lv[: cut - start], start & 0xFFFFFFFF, k0)
        _levels_stochastic(xs[cut - start:], mn, scale, max_level, lv[cut - start:], 0, k1)
    p0 = start * bits // 8
    _pack(lv, packed[p0: p0 + ((end - start) * bits + 7) // 8], bits)
    return True


@numba.njit(inline="always")
def _unpack(src, out, mn, unit, bits, accumulate, lv_buf):
    """Decode len(out) levels from src into out: mn + unit * level (two roundings, no FMA).
    lv_buf (uint8, at least len(out)) is scratch for the 1/3/5/6/7-bit widths."""
    m = out.shape[0]
    # Every width splits the bytes into a level buffer, then one shared decode pass: both loops
    # vectorize. Decoding straight from the bytes (two or four interleaved stores per byte) ran
    # 3x slower at 4 bits (0.44 vs 0.14 ms per 1M levels, accumulating; AVX2, one thread).
    if bits == 8:
        _decode_levels(src[:m], out, mn, unit, accumulate)
    elif bits == 4:
        full = (m // 2) * 2
        lv = lv_buf[:full]
        for j in range(m // 2):
            v = src[j]
            lv[2 * j] = v & np.uint8(15)
            lv[2 * j + 1] = v >> np.uint8(4)
        _decode_levels(lv, out[:full], mn, unit, accumulate)
        _unpack_tail(src, out, mn, unit, bits, accumulate, full)
    elif bits == 2:
        full = (m // 4) * 4
        lv = lv_buf[:full]
        for j in range(m // 4):
            v = src[j]
            lv[4 * j] = v & np.uint8(3)
            lv[4 * j + 1] = (v >> np.uint8(2)) & np.uint8(3)
            lv[4 * j + 2] = (v >> np.uint8(4)) & np.uint8(3)
            lv[4 * j + 3] = v >> np.uint8(6)
        _decode_levels(lv, out[:full], mn, unit, accumulate)
        _unpack_tail(src, out, mn, unit, bits, accumulate, full)
    else:
        # 1, 3, 5, 6, 7 bits: 8 levels fill `bits` bytes. Splitting whole 8-level groups into a
        # level buffer, then one shared decode pass, vectorizes both loops; decoding straight
        # from the bytes in one loop was slower (3-bit accumulate: 2.0 vs 1.7 ms per 12.5M).
        full = (m // 8) * 8
        lv = lv_buf[:full]
        if bits == 1:
            _unpack_levels1(src, lv)
        elif bits == 3:
            _unpack_levels3(src, lv)
        elif bits == 5:
            _unpack_levels5(src, lv)
        elif bits == 6:
            _unpack_levels6(src, lv)
        else:
            _unpack_levels7(src, lv)
        _decode_levels(lv, out[:full], mn, unit, accumulate)
        _unpack_tail(src, out, mn, unit, bits, accumulate, full)


@numba.njit(inline="always")
def _decode_levels(lv, out, mn, unit, accumulate):
    # two separate loops: a branch inside the body stops LLVM from vectorizing it
    if accumulate:
        for j in range(out.shape[0]):
            out[j] += mn + unit * np.float32(lv[j])
    else:
        for j in range(out.shape[0]):
            out[j] = mn + unit * np.float32(lv[j])


@numba.njit(inline="always")
def _unpack_levels1(src, lv):
    for g in range(lv.shape[0] // 8):
        for k in range(8):
            lv[8 * g + k] = (src[g] >> np.uint8(k)) & np.uint8(1)


@numba.njit(inline="always")
def _unpack_levels3(src, lv):
    for g in range(lv.shape[0] // 8):
        lv[8 * g] = src[3 * g] & np.uint8(7)
        lv[8 * g + 1] = (src[3 * g] >> np.uint8(3)) & np.uint8(7)
        lv[8 * g + 2] = ((src[3 * g] >> np.uint8(6)) | (src[3 * g + 1] << np.uint8(2))) & np.uint8(7)
        lv[8 * g + 3] = (src[3 * g + 1] >> np.uint8(1)) & np.uint8(7)
        lv[8 * g + 4] = (src[3 * g + 1] >> np.uint8(4)) & np.uint8(7)
        lv[8 * g + 5] = ((src[3 * g + 1] >> np.uint8(7)) | (src[3 * g + 2] << np.uint8(1))) & np.uint8(7)
        lv[8 * g + 6] = (src[3 * g + 2] >> np.uint8(2)) & np.uint8(7)
        lv[8 * g + 7] = src[3 * g + 2] >> np.uint8(5)


@numba.njit(inline="always")
def _unpack_levels5(src, lv):
    for g in range(lv.shape[0] // 8):
        lv[8 * g] = src[5 * g] & np.uint8(31)
        lv[8 * g + 1] = ((src[5 * g] >> np.uint8(5)) | (src[5 * g + 1] << np.uint8(3))) & np.uint8(31)
        lv[8 * g + 2] = (src[5 * g + 1] >> np.uint8(2)) & np.uint8(31)
        lv[8 * g + 3] = ((src[5 * g + 1] >> np.uint8(7)) | (src[5 * g + 2] << np.uint8(1))) & np.uint8(31)
        lv[8 * g + 4] = ((src[5 * g + 2] >> np.uint8(4)) | (src[5 * g + 3] << np.uint8(4))) & np.uint8(31)
        lv[8 * g + 5] = (src[5 * g + 3] >> np.uint8(1)) & np.uint8(31)
        lv[8 * g + 6] = ((src[5 * g + 3] >> np.uint8(6)) | (src[5 * g + 4] << np.uint8(2))) & np.uint8(31)
        lv[8 * g + 7] = src[5 * g + 4] >> np.uint8(3)


@numba.njit(inline="always")
def _unpack_levels6(src, lv):
    for g in range(lv.shape[0] // 8):
        lv[8 * g] = src[6 * g] & np.uint8(63)
        lv[8 * g + 1] = ((src[6 * g] >> np.uint8(6)) | (src[6 * g + 1] << np.uint8(2))) & np.uint8(63)
        lv[8 * g + 2] = ((src[6 * g + 1] >> np.uint8(4)) | (src[6 * g + 2] << np.uint8(4))) & np.uint8(63)
        lv[8 * g + 3] = src[6 * g + 2] >> np.uint8(2)
        lv[8 * g + 4] = src[6 * g + 3] & np.uint8(63)
        lv[8 * g + 5] = ((src[6 * g + 3] >> np.uint8(6)) | (src[6 * g + 4] << np.uint8(2))) & np.uint8(63)
        lv[8 * g + 6] = ((src[6 * g + 4] >> np.uint8(4)) | (src[6 * g + 5] << np.uint8(4))) & np.uint8(63)
        lv[8 * g + 7] = src[6 * g + 5] >> np.uint8(2)


@numba.njit(inline="always")
def _unpack_levels7(src, lv):
    for g in range(lv.shape[0] // 8):
        lv[8 * g] = src[7 * g] & np.uint8(127)
        lv[8 * g + 1] = ((src[7 * g] >> np.uint8(7)) | (src[7 * g + 1] << np.uint8(1))) & np.uint8(127)
        lv[8 * g + 2] = ((src[7 * g + 1] >> np.uint8(6)) | (src[7 * g + 2] << np.uint8(2))) & np.uint8(127)
        lv[8 * g + 3] = ((src[7 * g + 2] >> np.uint8(5)) | (src[7 * g + 3] << np.uint8(3))) & np.uint8(127)
        lv[8 * g + 4] = ((src[7 * g + 3] >> np.uint8(4)) | (src[7 * g + 4] << np.uint8(4))) & np.uint8(127)
        lv[8 * g + 5] = ((src[7 * g + 4] >> np.uint8(3)) | (src[7 * g + 5] << np.uint8(5))) & np.uint8(127)
        lv[8 * g + 6] = ((src[7 * g + 5] >> np.uint8(2)) | (src[7 * g + 6] << np.uint8(6))) & np.uint8(127)
        lv[8 * g + 7] = src[7 * g + 6] >> np.uint8(1)


@numba.njit(inline="always")
def _unpack_tail(src, out, mn, unit, bits, accumulate, first):
    """Decode levels [first, len(out)) (the last, partial group of a bucket) from the bytes."""
    mask = np.uint64((1 << bits) - 1)
    m = out.shape[0]
    i = first
    p = first * bits // 8
    while i < m:
        k_end = min(8, m - i)
        v = np.uint64(0)
        for j in range((k_end * bits + 7) // 8):
            v |= np.uint64(src[p + j]) << np.uint64(8 * j)
        for k in range(k_end):
            y = mn + unit * np.float32((v >> np.uint64(k * bits)) & mask)
            out[i + k] = out[i + k] + y if accumulate else y
        p += bits
        i += 8


@numba.njit(inline="always")
def _scale(out, scale):
    for j in range(out.shape[0]):
        out[j] *= scale


@numba.njit(nogil=True, cache=True)
def _decode_range(meta, packed, out, accumulate, numel, bits, bucket_size, scale, scaled, b0, b1, status):
    """Decode buckets [b0, b1) into out, or add into it. The caller has validated meta. With
    ``scaled`` (not accumulating), multiply each bucket by the float32 ``scale`` while it is
    still in L1: the products torch's ``out.mul_(scale)`` makes, without a second pass over out."""
    lv_buf = np.empty(bucket_size, dtype=np.uint8)
    for b in range(b0, b1):
        start = b * bucket_size
        end = min(start + bucket_size, numel)
        p0 = start * bits // 8
        src = packed[p0: p0 + ((end - start) * bits + 7) // 8]
        _unpack(src, out[start:end], meta[2 * b], meta[2 * b + 1], bits, accumulate, lv_buf)
        if scaled:
            _scale(out[start:end], scale)


@intrinsic
def _u8_at(typingctx, address):
    """A uint8 pointer to ``address``: the packed levels of a kept push, in a buffer that the
    caller of ``sum_maxmin_into`` holds and has checked the length of."""
    sig = types.CPointer(types.uint8)(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint8)))

    return sig, codegen


@numba.njit(nogil=True, cache=True)
def _sum_range(levels_at, metas, count, numel, bits, bucket_size, acc, from_acc, encode, residual,
               feedback, meta, packed, stochastic, key, b0, b1, status):
    """Sum buckets [b0, b1) of the first ``count`` encoded pushes (in arrival order; push k's
    (min, unit) pairs are metas[k, :2 * buckets], its packed levels start at address
    levels_at[k]), after acc if from_acc. Each bucket is summed in a scratch buffer that stays in
    L1, with exactly the additions of decoding into an accumulator one push at a time. Then
    either store the bucket's sum into acc (encode False), or encode it into meta and packed
    (the same bucket code as _encode_range; with feedback, the residual is added first and
    replaced by what the encoding left out, as api.encode_with_feedback does)."""
    x = np.empty(bucket_size, dtype=np.float32)
    lv_buf = np.empty(bucket_size, dtype=np.uint8)
    for b in range(b0, b1):
        start = b * bucket_size
        end = min(start + bucket_size, numel)
        xs = x[: end - start]
        p0 = start * bits // 8
        nbytes = ((end - start) * bits + 7) // 8
        first = 0
        if from_acc:
            xs[:] = acc[start:end]
        else:
            src = numba.carray(_u8_at(levels_at[0] + np.uint64(p0)), (nbytes,))
            _unpack(src, xs, metas[0, 2 * b], metas[0, 2 * b + 1], bits, False, lv_buf)
            first = 1
        for k in range(first, count):
            src = numba.carray(_u8_at(levels_at[k] + np.uint64(p0)), (nbytes,))
            _unpack(src, xs, metas[k, 2 * b], metas[k, 2 * b + 1], bits, True, lv_buf)
        if not encode:
            acc[start:end] = xs
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


@numba.njit(nogil=True, cache=True)
def _first_nonfinite(v, exp_mask):
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
def _first_bad_meta(meta, top_level):
    for b in range(meta.shape[0] // 2):
        mn = meta[2 * b]
        unit = meta[2 * b + 1]
        top = mn + unit * top_level  # float32, as decoding's top level is
        if not (np.isfinite(mn) and np.isfinite(unit) and unit >= np.float32(0.0) and np.isfinite(top)):
            return b
    return -1


def first_bad_meta(meta: np.ndarray, bits: int) -> int:
    """The first bucket whose (min, unit) pair in ``meta`` (float32, 2 per bucket, from the wire)
    is not finite, has unit < 0, or whose top level ``min + unit * (2**bits - 1)`` is not finite
    in float32; -1 if none. A payload's metadata may sit at any byte offset: an unaligned one is
    copied first (8 bytes per bucket), so one compiled kernel serves every payload."""
    if not meta.flags.aligned:
        meta = meta.copy()
    return int(_first_bad_meta(meta, np.float32((1 << bits) - 1)))


_EXPONENT_MASKS = {"<f4": (np.int32, 0x7F800000), "<f2": (np.int16, 0x7C00), "bf16": (np.int16, 0x7F80)}


def first_nonfinite(bits: np.ndarray, kind: str) -> int:
    """First NaN/Inf element of float data given as raw bytes/ints; kind: '<f4', '<f2', 'bf16'."""
    dtype, mask = _EXPONENT_MASKS[kind]
    if bits.size == 0:
        return -1
    return int(_first_nonfinite(bits.view(dtype), dtype(mask)))


# ---- threading ---------------------------------------------------------------------------------

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_threads = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def num_threads() -> int:
    return _threads


def set_num_threads(n: int) -> None:
    """Threads one CPU codec call may use (default: the CPUs this process may run on)."""
    global _threads, _pool
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    with _pool_lock:
        _threads = n
        # Not shut down: a call in flight on another thread still submits to it. Its threads
        # exit once the last such call drops it (ThreadPoolExecutor's own clean-up).
        _pool = None


def _pool_and_threads() -> tuple[ThreadPoolExecutor, int]:
    """The pool and the thread count it was made for, read together (set_num_threads may run
    on another thread). Created on first use, never at import: importing must not start threads."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, _threads - 1), thread_name_prefix="cgx-codec")
        return _pool, _threads


def _run_split(fn, nbuckets: int, args: tuple, columns: int, threads: int | None = None) -> np.ndarray:
    """Run fn(*args, b0, b1, status_row) over bucket ranges, the caller's thread taking one;
    the status rows (``columns`` int64 each, -1 where nothing was flagged). ``threads``: at most
    that many ranges (None: ``num_threads()``)."""
    pool, default_threads = _pool_and_threads()
    parts = max(1, min(default_threads if threads is None else threads, nbuckets // _MIN_BUCKETS_PER_THREAD))
    status = np.full((parts, columns), -1, dtype=np.int64)
    if parts == 1:
        fn(*args, 0, nbuckets, status[0])
        return status
    edges = [nbuckets * k // parts for k in range(parts + 1)]
    futures = [pool.submit(fn, *args, edges[k], edges[k + 1], status[k]) for k in range(1, parts)]
    fn(*args, edges[0], edges[1], status[0])
    for f in futures:
        f.result()
    return status


def _first_flagged(status: np.ndarray) -> tuple[int, int]:
    """(first bucket holding NaN/Inf or -1, first overflowing bucket or -1) over every part."""
    bad = status[:, 0][status[:, 0] >= 0]
    over = status[:, 1][status[:, 1] >= 0]
    return (int(bad.min()) if bad.size else -1), (int(over.min()) if over.size else -1)


def encode_maxmin_into(
    x: np.ndarray, meta: np.ndarray, packed: np.ndarray, bits: int, bucket_size: int,
    stochastic: bool, seed: int,
) -> tuple[int, int]:
    """Encode float32 x into meta (float32, 2 per bucket) and packed (uint8).

    Returns (first bucket holding NaN/Inf or -1, first overflowing bucket or -1)."""
    n = x.shape[0]
    if n == 0:
        return -1, -1
    nb = -(-n // bucket_size)
    key = rng.seed_key(seed) if stochastic else 0
    args = (x, x.view(np.int32), meta, packed, bits, bucket_size, stochastic, key)
    return _first_flagged(_run_split(_encode_range, nb, args, 2))


def decode_maxmin_into(
    meta: np.ndarray, packed: np.ndarray, out: np.ndarray, accumulate: bool, bits: int,
    bucket_size: int, scale: float = 1.0,
) -> None:
    """Decode into float32 out (or add into it). meta must already be validated. ``scale``
    (not with accumulate): multiply the decoded values by float32(scale), bit for bit as
    ``torch.Tensor.mul_(scale)`` would afterwards."""
    if accumulate and scale != 1.0:
        raise ValueError("scale is for a plain decode, not an accumulating one")
    n = out.shape[0]
    if n == 0:
        return
    nb = -(-n // bucket_size)
    args = (meta, packed, out, accumulate, n, bits, bucket_size, np.float32(scale), scale != 1.0)
    _run_split(_decode_range, nb, args, 1)


def sum_maxmin_into(
    levels: Sequence[np.ndarray], metas: np.ndarray, numel: int, bits: int, bucket_size: int,
    acc: np.ndarray | None, from_acc: bool, out: tuple[np.ndarray, np.ndarray] | None,
    residual: np.ndarray | None, stochastic: bool, seed: int, threads: int | None = None,
) -> tuple[int, int]:
    """Sum validated max-min pushes of these settings, after ``acc`` if ``from_acc``: push k's
    packed levels are ``levels[k]`` (uint8, read where they are: a shard passes the payloads as
    received) and its (min, unit) pairs ``metas[k]`` (float32). With ``out`` (meta, packed),
    encode the sum there (with ``residual``: error feedback, updated in place) and return what
    encode_maxmin_into returns; without, store the sum into ``acc``. The result is bit-identical
    to decoding the pushes one by one into an accumulator, then encoding it, however many
    ``threads`` (None: ``num_threads()``) the buckets are split over."""
    if numel == 0:
        return -1, -1
    if not levels and not from_acc:
        raise ValueError("nothing to sum: no pushes and no partial sum")
    nb = -(-numel // bucket_size)
    need = (numel * bits + 7) // 8
    # the kernel reads each push's levels through a raw pointer: every bound is checked here
    for lv in levels:
        if lv.dtype != np.uint8 or lv.ndim != 1 or not lv.flags.c_contiguous or lv.size < need:
            raise ValueError(f"levels must be contiguous uint8 arrays of at least {need} bytes, got "
                             f"{lv.dtype} {lv.shape}")
    if metas.dtype != np.float32 or metas.ndim != 2 or metas.shape[0] < len(levels) or metas.shape[1] < 2 * nb \
            or not metas.flags.c_contiguous:
        raise ValueError(f"metas must be a contiguous float32 array of at least ({len(levels)}, {2 * nb})")
    levels_at = np.array([lv.ctypes.data for lv in levels] or [0], dtype=np.uint64)
    meta, packed = out if out is not None else (_NO_F32, _NO_U8)
    key = rng.seed_key(seed) if stochastic and out is not None else 0
    args = (levels_at, metas, len(levels), numel, bits, bucket_size,
            acc if acc is not None else _NO_F32, from_acc, out is not None,
            residual if residual is not None else _NO_F32, residual is not None, meta, packed, stochastic, key)
    # levels stays referenced (this frame) until every part of the call has returned
    return _first_flagged(_run_split(_sum_range, nb, args, 2, threads))


_NO_F32 = np.empty(0, dtype=np.float32)  # placeholders: numba needs typed arrays for unused args
_NO_U8 = np.empty(0, dtype=np.uint8)
