"""Packing max-min levels into bytes and back, one specialization per bit width.

Level k of an 8-level group sits at bits [k * bits, (k + 1) * bits) of the group's ``bits``
bytes (LSB-first); a level crossing a byte boundary is split between two bytes. ``pack`` and
``unpack`` pick the width's loop with a chain of ``if bits == w`` tests: a kernel built for one
width (``cpu_loops``, ``bits`` a constant of its closure) has the other widths' branches pruned
by numba before they are typed, so a 4-bit job compiles the 4-bit loops only. The leaves are
ordinary functions, not ``inline="always"``: numba inlines such a function by re-running its
front end at every call site, once per nested call, which took 7 of the 12 s a summing kernel
took to compile; LLVM still inlines them into the kernel.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["pack", "unpack"]

# Why one straight-line loop per width with constant shifts: 8 levels of b bits are b whole
# bytes. A loop over a runtime `bits` did not vectorize (3-bit: 4x slower). uint8 shifts widen
# in numba, and storing into a uint8 array drops the bits that spill into the next byte.


@numba.njit(inline="always")
def pack(lv, out, bits):
    """Pack levels LSB-first into out (exactly ceil(len(lv) * bits / 8) bytes)."""
    m = lv.shape[0]
    if bits == 8:
        _pack8(lv, out)
    elif bits == 4:
        _pack4(lv, out)
    elif bits == 2:
        _pack2(lv, out)
    elif bits == 1:
        _pack1(lv, out)
    elif bits == 3:
        _pack3(lv, out)
    elif bits == 5:
        _pack5(lv, out)
    elif bits == 6:
        _pack6(lv, out)
    else:
        _pack7(lv, out)
    # the levels after the last whole group (fewer than one group: a bucket's tail)
    per = 8 // bits if 8 % bits == 0 else 8
    _pack_tail(lv, out, bits, (m // per) * per)


@numba.njit(inline="always")
def unpack(src, out, mn, unit, bits, accumulate, lv_buf):
    """Decode len(out) levels from src into out: mn + unit * level (two roundings, no FMA).
    lv_buf (uint8, at least len(out)) is scratch for the levels (not used at 8 bits)."""
    m = out.shape[0]
    # Every width splits the bytes into a level buffer, then one shared decode pass: both loops
    # vectorize. Decoding straight from the bytes (two or four interleaved stores per byte) ran
    # 3x slower at 4 bits (0.44 vs 0.14 ms per 1M levels, accumulating; AVX2, one thread), and
    # in one loop per group at 3 bits (2.0 vs 1.7 ms per 12.5M).
    if bits == 8:
        _decode_levels(src[:m], out, mn, unit, accumulate)
        return
    per = 8 // bits if 8 % bits == 0 else 8
    full = (m // per) * per
    lv = lv_buf[:full]
    if bits == 4:
        _split4(src, lv)
    elif bits == 2:
        _split2(src, lv)
    elif bits == 1:
        _split1(src, lv)
    elif bits == 3:
        _split3(src, lv)
    elif bits == 5:
        _split5(src, lv)
    elif bits == 6:
        _split6(src, lv)
    else:
        _split7(src, lv)
    _decode_levels(lv, out[:full], mn, unit, accumulate)
    _unpack_tail(src, out, mn, unit, bits, accumulate, full)


@numba.njit
def _pack8(lv, out):
    for j in range(lv.shape[0]):
        out[j] = lv[j]


@numba.njit
def _pack4(lv, out):
    for j in range(lv.shape[0] // 2):
        out[j] = lv[2 * j] | (lv[2 * j + 1] << np.uint8(4))


@numba.njit
def _pack2(lv, out):
    for j in range(lv.shape[0] // 4):
        out[j] = (lv[4 * j] | (lv[4 * j + 1] << np.uint8(2)) | (lv[4 * j + 2] << np.uint8(4))
                  | (lv[4 * j + 3] << np.uint8(6)))


@numba.njit
def _pack1(lv, out):
    for j in range(lv.shape[0] // 8):
        v = np.uint8(0)
        for k in range(8):
            v |= lv[8 * j + k] << np.uint8(k)
        out[j] = v


@numba.njit
def _pack3(lv, out):
    for g in range(lv.shape[0] // 8):
        out[3 * g] = lv[8 * g] | (lv[8 * g + 1] << np.uint8(3)) | (lv[8 * g + 2] << np.uint8(6))
        out[3 * g + 1] = ((lv[8 * g + 2] >> np.uint8(2)) | (lv[8 * g + 3] << np.uint8(1))
                          | (lv[8 * g + 4] << np.uint8(4)) | (lv[8 * g + 5] << np.uint8(7)))
        out[3 * g + 2] = ((lv[8 * g + 5] >> np.uint8(1))
                          | (lv[8 * g + 6] << np.uint8(2)) | (lv[8 * g + 7] << np.uint8(5)))


@numba.njit
def _pack5(lv, out):
    for g in range(lv.shape[0] // 8):
        out[5 * g] = lv[8 * g] | (lv[8 * g + 1] << np.uint8(5))
        out[5 * g + 1] = ((lv[8 * g + 1] >> np.uint8(3))
                          | (lv[8 * g + 2] << np.uint8(2)) | (lv[8 * g + 3] << np.uint8(7)))
        out[5 * g + 2] = (lv[8 * g + 3] >> np.uint8(1)) | (lv[8 * g + 4] << np.uint8(4))
        out[5 * g + 3] = ((lv[8 * g + 4] >> np.uint8(4))
                          | (lv[8 * g + 5] << np.uint8(1)) | (lv[8 * g + 6] << np.uint8(6)))
        out[5 * g + 4] = (lv[8 * g + 6] >> np.uint8(2)) | (lv[8 * g + 7] << np.uint8(3))


@numba.njit
def _pack6(lv, out):
    for g in range(lv.shape[0] // 8):
        out[6 * g] = lv[8 * g] | (lv[8 * g + 1] << np.uint8(6))
        out[6 * g + 1] = (lv[8 * g + 1] >> np.uint8(2)) | (lv[8 * g + 2] << np.uint8(4))
        out[6 * g + 2] = (lv[8 * g + 2] >> np.uint8(4)) | (lv[8 * g + 3] << np.uint8(2))
        out[6 * g + 3] = lv[8 * g + 4] | (lv[8 * g + 5] << np.uint8(6))
        out[6 * g + 4] = (lv[8 * g + 5] >> np.uint8(2)) | (lv[8 * g + 6] << np.uint8(4))
        out[6 * g + 5] = (lv[8 * g + 6] >> np.uint8(4)) | (lv[8 * g + 7] << np.uint8(2))


@numba.njit
def _pack7(lv, out):
    for g in range(lv.shape[0] // 8):
        out[7 * g] = lv[8 * g] | (lv[8 * g + 1] << np.uint8(7))
        out[7 * g + 1] = (lv[8 * g + 1] >> np.uint8(1)) | (lv[8 * g + 2] << np.uint8(6))
        out[7 * g + 2] = (lv[8 * g + 2] >> np.uint8(2)) | (lv[8 * g + 3] << np.uint8(5))
        out[7 * g + 3] = (lv[8 * g + 3] >> np.uint8(3)) | (lv[8 * g + 4] << np.uint8(4))
        out[7 * g + 4] = (lv[8 * g + 4] >> np.uint8(4)) | (lv[8 * g + 5] << np.uint8(3))
        out[7 * g + 5] = (lv[8 * g + 5] >> np.uint8(5)) | (lv[8 * g + 6] << np.uint8(2))
        out[7 * g + 6] = (lv[8 * g + 6] >> np.uint8(6)) | (lv[8 * g + 7] << np.uint8(1))


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


@numba.njit
def _split4(src, lv):
    for j in range(lv.shape[0] // 2):
        v = src[j]
        lv[2 * j] = v & np.uint8(15)
        lv[2 * j + 1] = v >> np.uint8(4)


@numba.njit
def _split2(src, lv):
    for j in range(lv.shape[0] // 4):
        v = src[j]
        lv[4 * j] = v & np.uint8(3)
        lv[4 * j + 1] = (v >> np.uint8(2)) & np.uint8(3)
        lv[4 * j + 2] = (v >> np.uint8(4)) & np.uint8(3)
        lv[4 * j + 3] = v >> np.uint8(6)


@numba.njit
def _split1(src, lv):
    for g in range(lv.shape[0] // 8):
        for k in range(8):
            lv[8 * g + k] = (src[g] >> np.uint8(k)) & np.uint8(1)


@numba.njit
def _split3(src, lv):
    for g in range(lv.shape[0] // 8):
        lv[8 * g] = src[3 * g] & np.uint8(7)
        lv[8 * g + 1] = (src[3 * g] >> np.uint8(3)) & np.uint8(7)
        lv[8 * g + 2] = ((src[3 * g] >> np.uint8(6)) | (src[3 * g + 1] << np.uint8(2))) & np.uint8(7)
        lv[8 * g + 3] = (src[3 * g + 1] >> np.uint8(1)) & np.uint8(7)
        lv[8 * g + 4] = (src[3 * g + 1] >> np.uint8(4)) & np.uint8(7)
        lv[8 * g + 5] = ((src[3 * g + 1] >> np.uint8(7)) | (src[3 * g + 2] << np.uint8(1))) & np.uint8(7)
        lv[8 * g + 6] = (src[3 * g + 2] >> np.uint8(2)) & np.uint8(7)
        lv[8 * g + 7] = src[3 * g + 2] >> np.uint8(5)


@numba.njit
def _split5(src, lv):
    for g in range(lv.shape[0] // 8):
        lv[8 * g] = src[5 * g] & np.uint8(31)
        lv[8 * g + 1] = ((src[5 * g] >> np.uint8(5)) | (src[5 * g + 1] << np.uint8(3))) & np.uint8(31)
        lv[8 * g + 2] = (src[5 * g + 1] >> np.uint8(2)) & np.uint8(31)
        lv[8 * g + 3] = ((src[5 * g + 1] >> np.uint8(7)) | (src[5 * g + 2] << np.uint8(1))) & np.uint8(31)
        lv[8 * g + 4] = ((src[5 * g + 2] >> np.uint8(4)) | (src[5 * g + 3] << np.uint8(4))) & np.uint8(31)
        lv[8 * g + 5] = (src[5 * g + 3] >> np.uint8(1)) & np.uint8(31)
        lv[8 * g + 6] = ((src[5 * g + 3] >> np.uint8(6)) | (src[5 * g + 4] << np.uint8(2))) & np.uint8(31)
        lv[8 * g + 7] = src[5 * g + 4] >> np.uint8(3)


@numba.njit
def _split6(src, lv):
    for g in range(lv.shape[0] // 8):
        lv[8 * g] = src[6 * g] & np.uint8(63)
        lv[8 * g + 1] = ((src[6 * g] >> np.uint8(6)) | (src[6 * g + 1] << np.uint8(2))) & np.uint8(63)
        lv[8 * g + 2] = ((src[6 * g + 1] >> np.uint8(4)) | (src[6 * g + 2] << np.uint8(4))) & np.uint8(63)
        lv[8 * g + 3] = src[6 * g + 2] >> np.uint8(2)
        lv[8 * g + 4] = src[6 * g + 3] & np.uint8(63)
        lv[8 * g + 5] = ((src[6 * g + 3] >> np.uint8(6)) | (src[6 * g + 4] << np.uint8(2))) & np.uint8(63)
        lv[8 * g + 6] = ((src[6 * g + 4] >> np.uint8(4)) | (src[6 * g + 5] << np.uint8(4))) & np.uint8(63)
        lv[8 * g + 7] = src[6 * g + 5] >> np.uint8(2)


@numba.njit
def _split7(src, lv):
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
def _decode_levels(lv, out, mn, unit, accumulate):
    # two separate loops: a branch inside the body stops LLVM from vectorizing it
    if accumulate:
        for j in range(out.shape[0]):
            out[j] += mn + unit * np.float32(lv[j])
    else:
        for j in range(out.shape[0]):
            out[j] = mn + unit * np.float32(lv[j])


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
