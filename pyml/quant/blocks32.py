"""Kernels for ggml's 32-value blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Block layouts (ggml-common.h; all little-endian, fp16 = IEEE half; "code" = the stored integer):

    Q4_0  18 bytes  d:fp16 | qs[16]                 value = d * (code - 8)
    Q4_1  20 bytes  d:fp16 | m:fp16 | qs[16]        value = d * code + m
    Q5_0  22 bytes  d:fp16 | qh:u32 | qs[16]        value = d * (code - 16)
    Q5_1  24 bytes  d:fp16 | m:fp16 | qh:u32 | qs[16]   value = d * code + m
    Q8_0  34 bytes  d:fp16 | qs[32]:int8            value = d * code

    4-bit codes: byte j of qs holds value j in its low nibble and value j+16 in its high nibble.
    5-bit codes: the same nibbles, plus bit j of qh as bit 4 of value j's code.

The row-level functions below are what kernel_set.py runs in its parallel loops (w a row of
a GGUF tensor, [nb*type_size] uint8, possibly read-only; `kind` the GGML type id, on which each
function specialises through numba.literally, so each type's inner loop compiles on its own):
    dequant_row(kind, w, y)           scalar loops: the reference decoding, embedding rows
    decode_row(kind, w, y)            vectorised decoding (same float ops)
    gemv_row(kind, w, xq, xd, xs, xp) w . x, int8 activations (activation.py; the default path)
    gemv_row_exact(kind, w, x, xsum)  w . x, float32 activations (exact to f32 rounding)
    tile(kind, wa, wb, xq, xd, xs, xp, t0, T)   8 dot products of a T > 1 product: weight rows
                                      wa, wb x activation rows t0..t0+3, int8 activations; each
                                      weight block is decoded once for the 4 activation rows

The integer kernels follow ggml's vec_dot: per block an integer dot of the weight codes with
the int8 activation (activation.py), then one float multiply-add by d_w * d_x. Code offsets
(Q4_0: 8, Q5_0: 16) are removed inside the integer dot with the activation's pair sums; the
mins of Q4_1/Q5_1 are added as m * (block sum of the activation).
"""

from __future__ import annotations

import numba
import numpy as np

from pyml.quant.ggml_types import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TYPE_SIZE
from pyml.core.simd import (add, dot32_f32, f32x8, fma, hsum, lane, lanes_f32, load_f32x8, load_fp16, load_fp16x8,
                            load_i16x16, load_i8x32, load_nibbles16, load_u32, mul, prefetch, store_f32x8, to_f32,
                            zeros_f32x8)
from pyml.core.simd_int import abs_u8, as_i8, bits_to_u8, maddubs, minus_i8, or_u8, shl_i16, sign_i8, sub_i16, sum_pairs



@numba.njit
def _type_size(kind):
    numba.literally(kind)
    return TYPE_SIZE[kind]


# --- reference decoding --------------------------------------------------------------------

@numba.njit
def dequant_row(kind, w, y):  # w [nb*type_size] u8 -> y [nb*32] f32
    numba.literally(kind)
    ts = _type_size(kind)
    for b in range(y.size // 32):
        o = ts * b
        d = load_fp16(w, o)
        if kind == Q8_0:
            for j in range(32):
                y[32 * b + j] = d * np.float32(np.int8(w[o + 2 + j]))
            continue
        m = load_fp16(w, o + 2) if kind == Q4_1 or kind == Q5_1 else np.float32(0.0)
        qh = load_u32(w, o + (2 if kind == Q5_0 else 4)) if kind == Q5_0 or kind == Q5_1 else np.uint32(0)
        qs = o + (2 if kind == Q4_0 else 4 if kind == Q4_1 else 6 if kind == Q5_0 else 8)
        for j in range(16):
            lo = np.int32(w[qs + j] & 15) | np.int32(((qh >> j) & 1) << 4)
            hi = np.int32(w[qs + j] >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            if kind == Q4_0:
                lo, hi = lo - 8, hi - 8
            elif kind == Q5_0:
                lo, hi = lo - 16, hi - 16
            if kind == Q4_1 or kind == Q5_1:
                y[32 * b + j] = d * np.float32(lo) + m
                y[32 * b + 16 + j] = d * np.float32(hi) + m
            else:
                y[32 * b + j] = d * np.float32(lo)
                y[32 * b + 16 + j] = d * np.float32(hi)


@numba.njit
def decode_row(kind, w, y):  # w [nb*ts] -> y [nb*32] f32, vectorised; same float ops as the reference
    numba.literally(kind)
    ts = _type_size(kind)
    for g in range(y.size // 32):
        o = ts * g
        c, s = _codes(kind, w, o)
        q = _centered(kind, c, s)
        d = f32x8(load_fp16(w, o))
        v0, v1 = mul(d, lanes_f32(q, 0)), mul(d, lanes_f32(q, 1))
        v2, v3 = mul(d, lanes_f32(q, 2)), mul(d, lanes_f32(q, 3))
        if kind == Q4_1 or kind == Q5_1:
            m = f32x8(_min(kind, w, o))
            v0, v1, v2, v3 = add(v0, m), add(v1, m), add(v2, m), add(v3, m)
        store_f32x8(y, 32 * g, v0)
        store_f32x8(y, 32 * g + 8, v1)
        store_f32x8(y, 32 * g + 16, v2)
        store_f32x8(y, 32 * g + 24, v3)


# --- one block -------------------------------------------------------------------------------

@numba.njit
def _codes(kind, w, o):
    """The block's 32 codes in value order (U8x32) and, for Q8_0, the signed codes (I8x32).

    For Q8_0 the unsigned part is |code| and the signs travel separately (ggml's abs/sign trick:
    maddubs needs an unsigned operand)."""
    numba.literally(kind)
    if kind == Q8_0:
        q = load_i8x32(w, o + 2)
        return abs_u8(q), q
    if kind == Q4_0:
        c = load_nibbles16(w, o + 2)
    elif kind == Q4_1:
        c = load_nibbles16(w, o + 4)
    elif kind == Q5_0:
        c = or_u8(load_nibbles16(w, o + 6), bits_to_u8(load_u32(w, o + 2), 16))
    else:
        c = or_u8(load_nibbles16(w, o + 8), bits_to_u8(load_u32(w, o + 4), 16))
    return c, as_i8(c)


@numba.njit
def _centered(kind, c, s):  # I8x32 of code - offset (Q4_0: 8, Q5_0: 16; others: the codes as they are)
    numba.literally(kind)
    if kind == Q4_0:
        return minus_i8(c, 8)
    if kind == Q5_0:
        return minus_i8(c, 16)
    return s


@numba.njit
def _min(kind, w, o):
    numba.literally(kind)
    if kind == Q4_1 or kind == Q5_1:
        return load_fp16(w, o + 2)
    return np.float32(0.0)


@numba.njit
def _idot(kind, c, s, y, p):
    """I32x8 lanes of sum((code - offset) * y) for one block; p = the activation pair sums."""
    numba.literally(kind)
    if kind == Q8_0:
        return sum_pairs(maddubs(c, sign_i8(y, s)))
    if kind == Q4_0:
        return sum_pairs(sub_i16(maddubs(c, y), shl_i16(p, 3)))
    if kind == Q5_0:
        return sum_pairs(sub_i16(maddubs(c, y), shl_i16(p, 4)))
    return sum_pairs(maddubs(c, y))


@numba.njit
def _block(kind, w, g, xq, xd, xs, xp, acc):
    """(acc + block g of row w . activation, Q4_1/Q5_1: the block's min term m * sum(x_block))."""
    numba.literally(kind)
    o = _type_size(kind) * g
    c, s = _codes(kind, w, o)
    i = _idot(kind, c, s, load_i8x32(xq, 32 * g), load_i16x16(xp, 16 * g))
    m = _min(kind, w, o) * xs[g] if kind == Q4_1 or kind == Q5_1 else np.float32(0.0)
    return fma(f32x8(load_fp16(w, o) * xd[g]), to_f32(i), acc), m


@numba.njit
def _block_exact(kind, w, g, x, xsum, acc):  # acc + block g of row w . x (float path)
    numba.literally(kind)
    o = _type_size(kind) * g
    c, s = _codes(kind, w, o)
    acc = fma(f32x8(load_fp16(w, o)), dot32_f32(_centered(kind, c, s), x, 32 * g), acc)
    if kind == Q4_1 or kind == Q5_1:  # the min: m * sum(x_block), spread over the 8 lanes
        acc = fma(f32x8(_min(kind, w, o)), f32x8(xsum[g] * np.float32(0.125)), acc)
    return acc


# --- T == 1 ----------------------------------------------------------------------------------

@numba.njit
def _block_of8(kind, w, g, j, dx, xq, xp, acc):  # acc + block g+j, its scale d*d_x in lane j of dx
    numba.literally(kind)
    o = _type_size(kind) * (g + j)
    c, s = _codes(kind, w, o)
    i = _idot(kind, c, s, load_i8x32(xq, 32 * (g + j)), load_i16x16(xp, 16 * (g + j)))
    return fma(lane(dx, j), to_f32(i), acc)


@numba.njit
def gemv_row(kind, w, xq, xd, xs, xp):  # w [nb*ts] . x
    numba.literally(kind)
    nb, ts = xd.size, _type_size(kind)
    a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    mins, tail = zeros_f32x8(), np.float32(0.0)  # Q4_1/Q5_1: sum of m * sum(x_block)
    if kind == Q4_0 or kind == Q8_0:
        # 4 blocks per step, each with its own scalar scale (measured faster for these two)
        step = 4
        for i in range(nb // 4):
            g = 4 * i
            prefetch(w, ts * g + 2048)  # ~2 KB ahead: the hardware prefetcher alone leaves gaps
            prefetch(w, ts * g + 2048 + 64)
            a0, _ = _block(kind, w, g, xq, xd, xs, xp, a0)
            a1, _ = _block(kind, w, g + 1, xq, xd, xs, xp, a1)
            a2, _ = _block(kind, w, g + 2, xq, xd, xs, xp, a2)
            a3, _ = _block(kind, w, g + 3, xq, xd, xs, xp, a3)
    else:
        # 8 blocks per step: their 8 scales (and mins) are converted and scaled as one vector
        step = 8
        for i in range(nb // 8):
            g = 8 * i
            prefetch(w, ts * g + 2048)
            prefetch(w, ts * g + 2048 + 64)
            prefetch(w, ts * g + 2048 + 128)
            dx = mul(load_fp16x8(w, ts * g, ts), load_f32x8(xd, g))
            if kind == Q4_1 or kind == Q5_1:
                mins = fma(load_fp16x8(w, ts * g + 2, ts), load_f32x8(xs, g), mins)
            a0 = _block_of8(kind, w, g, 0, dx, xq, xp, a0)
            a1 = _block_of8(kind, w, g, 1, dx, xq, xp, a1)
            a2 = _block_of8(kind, w, g, 2, dx, xq, xp, a2)
            a3 = _block_of8(kind, w, g, 3, dx, xq, xp, a3)
            a0 = _block_of8(kind, w, g, 4, dx, xq, xp, a0)
            a1 = _block_of8(kind, w, g, 5, dx, xq, xp, a1)
            a2 = _block_of8(kind, w, g, 6, dx, xq, xp, a2)
            a3 = _block_of8(kind, w, g, 7, dx, xq, xp, a3)
    for g in range(nb - nb % step, nb):
        a0, m = _block(kind, w, g, xq, xd, xs, xp, a0)
        tail += m
    return hsum(add(add(a0, a1), add(a2, a3))) + (hsum(mins) + tail)


@numba.njit
def gemv_row_exact(kind, w, x, xsum):
    numba.literally(kind)
    nb = x.size // 32
    a0, a1 = zeros_f32x8(), zeros_f32x8()
    for i in range(nb // 2):
        a0 = _block_exact(kind, w, 2 * i, x, xsum, a0)
        a1 = _block_exact(kind, w, 2 * i + 1, x, xsum, a1)
    if nb % 2:
        a0 = _block_exact(kind, w, nb - 1, x, xsum, a0)
    return hsum(add(a0, a1))


# --- T > 1 -----------------------------------------------------------------------------------

@numba.njit
def _tile_step(kind, c, s, dv, mv, y, p, xv, sv, acc):
    # one weight block x one activation row; mv = m/8 and sv = block sum of x, in every lane
    numba.literally(kind)
    acc = fma(mul(dv, xv), to_f32(_idot(kind, c, s, y, p)), acc)
    if kind == Q4_1 or kind == Q5_1:
        acc = fma(mv, sv, acc)
    return acc


@numba.njit
def tile(kind, wa, wb, xq, xd, xs, xp, t0, T):
    """8 dot products: weight rows wa, wb x activation rows t0..t0+3 (clamped to T-1).

    Returns the accumulators; every weight block is decoded once for the 4 activation rows."""
    numba.literally(kind)
    t1, t2, t3 = min(t0 + 1, T - 1), min(t0 + 2, T - 1), min(t0 + 3, T - 1)
    a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    b0, b1, b2, b3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    ts = _type_size(kind)
    for g in range(xd.shape[1]):
        o = ts * g
        ca, sa = _codes(kind, wa, o)
        cb, sb = _codes(kind, wb, o)
        da, db = f32x8(load_fp16(wa, o)), f32x8(load_fp16(wb, o))
        ma = f32x8(_min(kind, wa, o) * np.float32(0.125))  # the min, spread over 8 lanes
        mb = f32x8(_min(kind, wb, o) * np.float32(0.125))
        for k in range(4):  # unrolled by LLVM: the trip count is constant
            t = t0 if k == 0 else t1 if k == 1 else t2 if k == 2 else t3
            y, p = load_i8x32(xq[t], 32 * g), load_i16x16(xp[t], 16 * g)
            xv = f32x8(xd[t, g])
            sv = f32x8(xs[t, g])
            if k == 0:
                a0 = _tile_step(kind, ca, sa, da, ma, y, p, xv, sv, a0)
                b0 = _tile_step(kind, cb, sb, db, mb, y, p, xv, sv, b0)
            elif k == 1:
                a1 = _tile_step(kind, ca, sa, da, ma, y, p, xv, sv, a1)
                b1 = _tile_step(kind, cb, sb, db, mb, y, p, xv, sv, b1)
            elif k == 2:
                a2 = _tile_step(kind, ca, sa, da, ma, y, p, xv, sv, a2)
                b2 = _tile_step(kind, cb, sb, db, mb, y, p, xv, sv, b2)
            else:
                a3 = _tile_step(kind, ca, sa, da, ma, y, p, xv, sv, a3)
                b3 = _tile_step(kind, cb, sb, db, mb, y, p, xv, sv, b3)
    return a0, a1, a2, a3, b0, b1, b2, b3
