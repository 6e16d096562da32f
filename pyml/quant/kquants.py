"""Kernels for ggml's K-quants: 256-value superblocks Q4_K, Q5_K, Q6_K.

Superblock layouts (ggml-common.h, QK_K = 256; little-endian; fp16 = IEEE half):

    Q4_K  144 bytes  d:fp16 | dmin:fp16 | scales[12] | qs[128]
    Q5_K  176 bytes  d:fp16 | dmin:fp16 | scales[12] | qh[32] | qs[128]
    Q6_K  210 bytes  ql[128] | qh[64] | scales[16]:int8 | d:fp16

Q4_K / Q5_K: 8 sub-blocks of 32 values, sub-block j has a 6-bit scale sc[j] and min mn[j]
(get_scale_min_k4):  j < 4: sc = scales[j] & 63,  mn = scales[j+4] & 63
                     j >= 4: sc = (scales[j+4] & 15) | (scales[j-4] >> 6) << 4,
                             mn = (scales[j+4] >> 4) | (scales[j] >> 6) << 4
    qs is 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles and sub-block
    2c+1 in its high nibbles (value l of the sub-block in byte l). Q5_K adds bit j of qh[l] as
    bit 4 of value l of sub-block j.     value = d * sc[j] * code - dmin * mn[j]

Q6_K: two halves of 128 values; half h uses ql[64h:64h+64], qh[32h:32h+32], scales[8h:8h+8].
    For l < 32, the 4 runs of 32 values of the half are
        value l      : low nibble of ql[l]     | (qh[l] >> 0 & 3) << 4
        value l + 32 : low nibble of ql[l+32]  | (qh[l] >> 2 & 3) << 4
        value l + 64 : high nibble of ql[l]    | (qh[l] >> 4 & 3) << 4
        value l + 96 : high nibble of ql[l+32] | (qh[l] >> 6 & 3) << 4
    and value e of the half has scale scales[8h + e // 16].   value = d * scale * (code - 32)

Kernels work in 32-value groups (g = 8 * superblock + group) so the int8 activation format is
the same as for the 32-value blocks (activation.py). Per group: an integer dot of the codes with
the activation, times d*sc*d_x (Q6_K: the two 16-value scales enter the integer dot through
vpmaddwd). Mins of Q4_K/Q5_K are added per superblock as -dmin * sum(mn[j] * sum(x_group j)).
The same row-level functions as blocks32.py, for kernel_set.py; w is a row of [nsb * type_size] uint8.
"""

from __future__ import annotations

import numba
import numpy as np

from pyml.quant.ggml_types import Q4_K, Q5_K, Q6_K, TYPE_SIZE
from pyml.core.simd512 import (add_i32x16, as_i8x64, dpbusd16, f32x16, fma16, load_f32x16, load_i32x16,
                               load_u8x4_bcast16, load_u8x64, mul16, store_f32x16, sub_i32x16, to_f32x16, zeros_f32x16,
                               zeros_i32x16)
from pyml.core.simd import (HAVE_VNNI, add, dot16_f32, dot32_f32, f32x8, fma, fnma, hsum, lane, lanes_f32, load_f32x8,
                            load_fp16, load_i16x16, load_i32x8, load_i8x16_i16, load_i8x32, load_u8x32,
                            load_u8x4_bcast, mul, prefetch, splat_u8, store_f32x8, store_i16x16, store_i32x8,
                            store_i8x32, sub, to_f32, transpose_u32, zeros_f32x8, zeros_i32x8)
from pyml.core.simd_int import (add_i16, add_i32, and_u8, as_i8, bit_to_u8, dpbusd, i16_halves, kscales, madd, maddubs,
                                minus_i8, nibbles_hi, nibbles_lo, or_u8, pair_i16, shl_i16, shl_u8, shr_u8, sub_i16,
                                sub_lanes_i32, sum_pairs)



@numba.njit
def _type_size(kind):
    numba.literally(kind)
    return TYPE_SIZE[kind]


@numba.njit
def _scale_min(w, o, j):  # 6-bit (sc, mn) of sub-block j of the Q4_K/Q5_K superblock at byte o
    s = o + 4
    if j < 4:
        return np.int32(w[s + j] & 63), np.int32(w[s + j + 4] & 63)
    sc = np.int32(w[s + j + 4] & 15) | (np.int32(w[s + j - 4] >> 6) << 4)
    mn = np.int32(w[s + j + 4] >> 4) | (np.int32(w[s + j] >> 6) << 4)
    return sc, mn


# --- reference decoding --------------------------------------------------------------------

@numba.njit
def dequant_row(kind, w, y):  # w [nsb*type_size] u8 -> y [nsb*256] f32, scalar loops
    numba.literally(kind)
    ts = _type_size(kind)
    for sb in range(y.size // 256):
        o = ts * sb
        e0 = 256 * sb
        if kind == Q6_K:
            d = load_fp16(w, o + 208)
            for h in range(2):
                ql, qh, sc = o + 64 * h, o + 128 + 32 * h, o + 192 + 8 * h
                for l in range(32):
                    q1 = np.int32(w[ql + l] & 15) | (np.int32((w[qh + l] >> 0) & 3) << 4)
                    q2 = np.int32(w[ql + l + 32] & 15) | (np.int32((w[qh + l] >> 2) & 3) << 4)
                    q3 = np.int32(w[ql + l] >> 4) | (np.int32((w[qh + l] >> 4) & 3) << 4)
                    q4 = np.int32(w[ql + l + 32] >> 4) | (np.int32((w[qh + l] >> 6) & 3) << 4)
                    e = e0 + 128 * h + l
                    y[e] = (d * np.float32(np.int8(w[sc + l // 16]))) * np.float32(q1 - 32)
                    y[e + 32] = (d * np.float32(np.int8(w[sc + 2 + l // 16]))) * np.float32(q2 - 32)
                    y[e + 64] = (d * np.float32(np.int8(w[sc + 4 + l // 16]))) * np.float32(q3 - 32)
                    y[e + 96] = (d * np.float32(np.int8(w[sc + 6 + l // 16]))) * np.float32(q4 - 32)
            continue
        d, dmin = load_fp16(w, o), load_fp16(w, o + 2)
        qs = o + (16 if kind == Q4_K else 48)
        for j in range(8):
            sc, mn = _scale_min(w, o, j)
            dl, ml = d * np.float32(sc), dmin * np.float32(mn)
            for l in range(32):
                byte = w[qs + 32 * (j // 2) + l]
                q = np.int32(byte & 15) if j % 2 == 0 else np.int32(byte >> 4)
                if kind == Q5_K:
                    q |= np.int32((w[o + 16 + l] >> j) & 1) << 4
                y[e0 + 32 * j + l] = dl * np.float32(q) - ml


@numba.njit
def decode_row(kind, w, y):  # w [nsb*ts] -> y [nsb*256] f32, vectorised; same float ops as the reference
    numba.literally(kind)
    ts = _type_size(kind)
    for sb in range(y.size // 256):
        o = ts * sb
        ds, dm, sc16 = _scales(kind, w, o)
        for j in range(8):
            _decode_group(kind, w, o, j, ds, dm, y, 256 * sb + 32 * j)


@numba.njit
def _decode_group(kind, w, o, j, ds, dm, y, e):  # y[e : e+32] = values of group j
    numba.literally(kind)
    c = _codes(kind, w, o, j)
    if kind == Q6_K:
        q, d, sc = minus_i8(c, 32), load_fp16(w, o + 208), o + 192 + 2 * j
        da, db = f32x8(d * np.float32(np.int8(w[sc]))), f32x8(d * np.float32(np.int8(w[sc + 1])))
        store_f32x8(y, e, mul(da, lanes_f32(q, 0)))
        store_f32x8(y, e + 8, mul(da, lanes_f32(q, 1)))
        store_f32x8(y, e + 16, mul(db, lanes_f32(q, 2)))
        store_f32x8(y, e + 24, mul(db, lanes_f32(q, 3)))
        return
    d, m = lane(ds, j), lane(dm, j)
    store_f32x8(y, e, sub(mul(d, lanes_f32(c, 0)), m))
    store_f32x8(y, e + 8, sub(mul(d, lanes_f32(c, 1)), m))
    store_f32x8(y, e + 16, sub(mul(d, lanes_f32(c, 2)), m))
    store_f32x8(y, e + 24, sub(mul(d, lanes_f32(c, 3)), m))


# --- one 32-value group ----------------------------------------------------------------------

@numba.njit
def _codes(kind, w, o, j):
    """The 32 codes (U8x32, value order) of group j (0-7) of the superblock at byte o."""
    numba.literally(kind)
    if kind == Q6_K:
        h, k = j // 4, j % 4
        qh = load_u8x32(w, o + 128 + 32 * h)
        ql = load_u8x32(w, o + 64 * h + 32 * (k % 2))
        low = nibbles_lo(ql) if k < 2 else nibbles_hi(ql)
        if k == 0:
            high = and_u8(shl_u8(qh, 4), 0x30)
        elif k == 1:
            high = and_u8(shl_u8(qh, 2), 0x30)
        elif k == 2:
            high = and_u8(qh, 0x30)
        else:
            high = and_u8(shr_u8(qh, 2), 0x30)
        return or_u8(low, high)
    qs = load_u8x32(w, o + (16 if kind == Q4_K else 48) + 32 * (j // 2))
    c = nibbles_lo(qs) if j % 2 == 0 else nibbles_hi(qs)
    if kind == Q5_K:
        c = or_u8(c, bit_to_u8(load_u8x32(w, o + 16), j, 16))
    return c


@numba.njit
def _scales(kind, w, o):
    """Per superblock: (F32x8 lane j = float scale of group j, F32x8 lane j = min of group j,
    I16x16 of the 16 int8 scales (Q6_K)). Q4_K/Q5_K: d*sc[j] and dmin*mn[j]; Q6_K: d and 0."""
    numba.literally(kind)
    if kind == Q6_K:
        return f32x8(load_fp16(w, o + 208)), zeros_f32x8(), load_i8x16_i16(w, o + 192)
    sc, mn = kscales(w, o + 4)
    return mul(f32x8(load_fp16(w, o)), sc), mul(f32x8(load_fp16(w, o + 2)), mn), i16_halves(0, 0)


@numba.njit
def _idot(kind, c, sc16, j, y, p):  # I32x8: integer dot of group j's codes with y (Q6_K: scaled)
    numba.literally(kind)
    if kind == Q6_K:
        return madd(sub_i16(maddubs(c, y), shl_i16(p, 5)), pair_i16(sc16, 2 * j))
    return sum_pairs(maddubs(c, y))


@numba.njit
def _group_int(kind, w, o, j, g, xq, xp, dx, sc16, acc):  # acc + group j (int path)
    numba.literally(kind)
    i = _idot(kind, _codes(kind, w, o, j), sc16, j, load_i8x32(xq, 32 * g), load_i16x16(xp, 16 * g))
    return fma(lane(dx, j), to_f32(i), acc)


@numba.njit
def _group_exact(kind, w, o, j, g, x, ds, acc):  # acc + group j (float path); ds = float scales
    numba.literally(kind)
    c = _codes(kind, w, o, j)
    if kind == Q6_K:  # two 16-value halves with their own int8 scales
        q, d, sc = minus_i8(c, 32), load_fp16(w, o + 208), o + 192 + 2 * j
        acc = fma(f32x8(d * np.float32(np.int8(w[sc]))), dot16_f32(q, 0, x, 32 * g), acc)
        return fma(f32x8(d * np.float32(np.int8(w[sc + 1]))), dot16_f32(q, 1, x, 32 * g + 16), acc)
    return fma(lane(ds, j), dot32_f32(as_i8(c), x, 32 * g), acc)


# --- T == 1 ----------------------------------------------------------------------------------

@numba.njit
def gemv_row(kind, w, xq, xd, xs, xp):  # w [nsb*ts] . x
    numba.literally(kind)
    ts = _type_size(kind)
    a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    mins = zeros_f32x8()
    for sb in range(xd.size // 8):
        o, g = ts * sb, 8 * sb
        prefetch(w, o + 2048)  # ~2 KB ahead: the hardware prefetcher alone leaves gaps
        prefetch(w, o + 2048 + 64)
        prefetch(w, o + 2048 + 128)
        ds, dm, sc16 = _scales(kind, w, o)
        dx = mul(ds, load_f32x8(xd, g))  # lane j: weight scale x activation scale of group j
        if kind != Q6_K:
            mins = fma(dm, load_f32x8(xs, g), mins)
        a0 = _group_int(kind, w, o, 0, g, xq, xp, dx, sc16, a0)
        a1 = _group_int(kind, w, o, 1, g + 1, xq, xp, dx, sc16, a1)
        a2 = _group_int(kind, w, o, 2, g + 2, xq, xp, dx, sc16, a2)
        a3 = _group_int(kind, w, o, 3, g + 3, xq, xp, dx, sc16, a3)
        a0 = _group_int(kind, w, o, 4, g + 4, xq, xp, dx, sc16, a0)
        a1 = _group_int(kind, w, o, 5, g + 5, xq, xp, dx, sc16, a1)
        a2 = _group_int(kind, w, o, 6, g + 6, xq, xp, dx, sc16, a2)
        a3 = _group_int(kind, w, o, 7, g + 7, xq, xp, dx, sc16, a3)
    return hsum(add(add(a0, a1), add(a2, a3))) - hsum(mins)


@numba.njit
def gemv_row_exact(kind, w, x, xsum):
    numba.literally(kind)
    ts = _type_size(kind)
    a0, a1 = zeros_f32x8(), zeros_f32x8()
    mins = zeros_f32x8()
    for sb in range(x.size // 256):
        o, g = ts * sb, 8 * sb
        ds, dm, sc16 = _scales(kind, w, o)
        if kind != Q6_K:
            mins = fma(dm, load_f32x8(xsum, g), mins)
        a0 = _group_exact(kind, w, o, 0, g, x, ds, a0)
        a1 = _group_exact(kind, w, o, 1, g + 1, x, ds, a1)
        a0 = _group_exact(kind, w, o, 2, g + 2, x, ds, a0)
        a1 = _group_exact(kind, w, o, 3, g + 3, x, ds, a1)
        a0 = _group_exact(kind, w, o, 4, g + 4, x, ds, a0)
        a1 = _group_exact(kind, w, o, 5, g + 5, x, ds, a1)
        a0 = _group_exact(kind, w, o, 6, g + 6, x, ds, a0)
        a1 = _group_exact(kind, w, o, 7, g + 7, x, ds, a1)
    return hsum(add(a0, a1)) - hsum(mins)


# --- T > 1 -----------------------------------------------------------------------------------

@numba.njit
def _tile_group(kind, wa, wb, o, j, g, xq, xd, xp, ts_, accs):
    """Group j of the superblock at byte o, for weight rows wa, wb x activation rows ts_ (4)."""
    numba.literally(kind)
    (a0, a1, a2, a3, b0, b1, b2, b3), (dsa, dsb, sca, scb) = accs
    ca, cb = _codes(kind, wa, o, j), _codes(kind, wb, o, j)
    da, db = lane(dsa, j), lane(dsb, j)
    for k in range(4):
        t = ts_[k]
        y, p = load_i8x32(xq[t], 32 * g), load_i16x16(xp[t], 16 * g)
        xv = f32x8(xd[t, g])
        ia = to_f32(_idot(kind, ca, sca, j, y, p))
        ib = to_f32(_idot(kind, cb, scb, j, y, p))
        if k == 0:
            a0, b0 = fma(mul(da, xv), ia, a0), fma(mul(db, xv), ib, b0)
        elif k == 1:
            a1, b1 = fma(mul(da, xv), ia, a1), fma(mul(db, xv), ib, b1)
        elif k == 2:
            a2, b2 = fma(mul(da, xv), ia, a2), fma(mul(db, xv), ib, b2)
        else:
            a3, b3 = fma(mul(da, xv), ia, a3), fma(mul(db, xv), ib, b3)
    return (a0, a1, a2, a3, b0, b1, b2, b3), (dsa, dsb, sca, scb)


@numba.njit
def tile(kind, wa, wb, xq, xd, xs, xp, t0, T):
    """8 dot products: weight rows wa, wb x activation rows t0..t0+3 (clamped to T-1);
    each group of weights is decoded once for the 4 activation rows."""
    numba.literally(kind)
    ts_ = (t0, min(t0 + 1, T - 1), min(t0 + 2, T - 1), min(t0 + 3, T - 1))
    z = zeros_f32x8()
    accs = (z, z, z, z, z, z, z, z)
    ts = _type_size(kind)
    for sb in range(xd.shape[1] // 8):
        o, g = ts * sb, 8 * sb
        dsa, dma, sca = _scales(kind, wa, o)
        dsb, dmb, scb = _scales(kind, wb, o)
        a0, a1, a2, a3, b0, b1, b2, b3 = accs
        if kind != Q6_K:  # the mins, once per superblock: lanes sum to -sum_j dmin*mn[j]*sum(x_j)
            a0, b0 = fnma(dma, load_f32x8(xs[ts_[0]], g), a0), fnma(dmb, load_f32x8(xs[ts_[0]], g), b0)
            a1, b1 = fnma(dma, load_f32x8(xs[ts_[1]], g), a1), fnma(dmb, load_f32x8(xs[ts_[1]], g), b1)
            a2, b2 = fnma(dma, load_f32x8(xs[ts_[2]], g), a2), fnma(dmb, load_f32x8(xs[ts_[2]], g), b2)
            a3, b3 = fnma(dma, load_f32x8(xs[ts_[3]], g), a3), fnma(dmb, load_f32x8(xs[ts_[3]], g), b3)
        st = ((a0, a1, a2, a3, b0, b1, b2, b3), (dsa, dsb, sca, scb))
        st = _tile_group(kind, wa, wb, o, 0, g, xq, xd, xp, ts_, st)
        st = _tile_group(kind, wa, wb, o, 1, g + 1, xq, xd, xp, ts_, st)
        st = _tile_group(kind, wa, wb, o, 2, g + 2, xq, xd, xp, ts_, st)
        st = _tile_group(kind, wa, wb, o, 3, g + 3, xq, xd, xp, ts_, st)
        st = _tile_group(kind, wa, wb, o, 4, g + 4, xq, xd, xp, ts_, st)
        st = _tile_group(kind, wa, wb, o, 5, g + 5, xq, xd, xp, ts_, st)
        st = _tile_group(kind, wa, wb, o, 6, g + 6, xq, xd, xp, ts_, st)
        st = _tile_group(kind, wa, wb, o, 7, g + 7, xq, xd, xp, ts_, st)
        accs = st[0]
    return accs


# --- T > 1 on VNNI: Q6_K, 8 or 16 rows at a time as signed int8 tiles ------------------------
# The file-layout tile above spends a vpmaddubsw, a 16-bit offset subtraction, a vpmaddwd with the
# two 16-value scales, a conversion and two float ops on every row, group and token: 13% of the
# vpdpbusd peak. Here each thread first transcodes 8 rows (16 on the avx512_vnni path) into the x8
# form of Q8_0 (interleaved.py: chunk k of a 32-value block = values 4k..4k+3 of each row) with
# codes - 32 as signed bytes, then runs the Q8_0 GEMM's loop over it: one vpdpbusd per 8 (16) rows x
# 4 values x token, the two 16-value halves of a block (chunks 0-3 and 4-7) each with its own float
# scale d * sc per row. The transcode costs ~1/T of the dots. Activations are offset by 128 as for
# Q8_0 on VNNI, and 128 x each half's code sum comes off (the same integers as the file-layout path).
# On 512-bit vectors the 16 rows' chunk is one 64-byte load, as the 8 rows' is one 32-byte load.
# Without VNNI the same tiles go three at a time through vpmaddubsw (next section): one tile at a
# time they took Gemma's 640x2048 and 1536x768 from 18% to 33-37% of that instruction's peak (the
# file-layout tile pays a vpmaddwd, a 16-bit offset and a float scale per 16 values and row).

@numba.njit
def _transcode_q6k(w, r0, rows, codes, scales, corr):
    """Rows r0..r0+rows-1 (rows = 8 or 16) of the Q6_K matrix w [R, nsb * 210] (rows past R as
    zeros) -> codes uint8 [nb * 32 * rows] (block b: 8 chunks of [rows][4 bytes] of signed codes
    - 32), scales float32 [nb * 2 * rows] and corr int32 [nb * 2 * rows] (half h of block b, row r
    at 2 rows b + rows h + r: d * sc and 128 x the half's code sum).

    A superblock's codes are decoded row by row in value order into `stage`, then transposed as
    4-byte words into the chunks (transpose_u32), in registers: copied word by word it cost more
    than twice as much (the journal's "Figures that were in the code")."""
    nb = codes.size // (32 * rows)
    stage = np.empty(256 * rows, np.uint8)  # row r's 256 codes - 32 at 256 r
    for s in range(nb // 8):
        o = 210 * s
        for r in range(rows):
            if r0 + r >= w.shape[0]:
                stage[256 * r:256 * r + 256] = 0
                for j in range(8):
                    b = 8 * s + j
                    scales[2 * rows * b + r] = scales[2 * rows * b + rows + r] = 0.0
                continue
            wr = w[r0 + r]
            d = load_fp16(wr, o + 208)
            for j in range(8):
                b = 8 * s + j
                store_i8x32(stage, 256 * r + 32 * j, minus_i8(_codes(Q6_K, wr, o, j), 32))
                scales[2 * rows * b + r] = d * np.float32(np.int8(wr[o + 192 + 2 * j]))
                scales[2 * rows * b + rows + r] = d * np.float32(np.int8(wr[o + 193 + 2 * j]))
        # a block of `rows` words of every row (2 groups at 16 rows, 1 at 8) is `rows` chunks
        for cb in range(64 // rows):
            if rows == 16:
                transpose_u32(stage, 64 * cb, 256, codes, 4096 * s + 1024 * cb, 16)
            else:
                transpose_u32(stage, 32 * cb, 256, codes, 2048 * s + 256 * cb, 8)
    c128 = splat_u8(128)
    for b in range(nb):
        for q in range(rows // 8):  # 8 rows (32 bytes of a chunk) at a time
            h0, h1 = zeros_i32x8(), zeros_i32x8()
            for k in range(4):
                h0 = dpbusd(h0, c128, as_i8(load_u8x32(codes, 32 * rows * b + 4 * rows * k + 32 * q)))
                h1 = dpbusd(h1, c128, as_i8(load_u8x32(codes, 32 * rows * b + 4 * rows * (k + 4) + 32 * q)))
            store_i32x8(corr, 2 * rows * b + 8 * q, h0)
            store_i32x8(corr, 2 * rows * b + rows + 8 * q, h1)


@numba.njit
def _half(codes, c, y, yo):  # I32x8: 4 chunks at byte c (16 values of 8 rows) . y[yo : yo+16], two chains
    a = dpbusd(dpbusd(zeros_i32x8(), load_u8x4_bcast(y, yo), as_i8(load_u8x32(codes, c))),
               load_u8x4_bcast(y, yo + 8), as_i8(load_u8x32(codes, c + 64)))
    b = dpbusd(dpbusd(zeros_i32x8(), load_u8x4_bcast(y, yo + 4), as_i8(load_u8x32(codes, c + 32))),
               load_u8x4_bcast(y, yo + 12), as_i8(load_u8x32(codes, c + 96)))
    return add_i32(a, b)


@numba.njit
def _q6k_block(codes, scales, corr, b, y, yd, acc):  # acc + block b of the 8 transcoded rows . token y
    i0 = sub_lanes_i32(_half(codes, 256 * b, y, 32 * b), load_i32x8(corr, 16 * b))
    i1 = sub_lanes_i32(_half(codes, 256 * b + 128, y, 32 * b + 16), load_i32x8(corr, 16 * b + 8))
    # the two halves' scales first, then the token's: 5 float ops per block and token, not 6
    f = fma(load_f32x8(scales, 16 * b + 8), to_f32(i1), mul(load_f32x8(scales, 16 * b), to_f32(i0)))
    return fma(f, f32x8(yd), acc)


@numba.njit
def _half16(codes, c, y, yo):  # I32x16: _half on 16 rows (a chunk is 64 bytes)
    a = dpbusd16(dpbusd16(zeros_i32x16(), load_u8x4_bcast16(y, yo), as_i8x64(load_u8x64(codes, c))),
                 load_u8x4_bcast16(y, yo + 8), as_i8x64(load_u8x64(codes, c + 128)))
    b = dpbusd16(dpbusd16(zeros_i32x16(), load_u8x4_bcast16(y, yo + 4), as_i8x64(load_u8x64(codes, c + 64))),
                 load_u8x4_bcast16(y, yo + 12), as_i8x64(load_u8x64(codes, c + 192)))
    return add_i32x16(a, b)


@numba.njit
def _q6k_block16(codes, scales, corr, b, y, yd, acc):  # _q6k_block on 16 transcoded rows
    i0 = sub_i32x16(_half16(codes, 512 * b, y, 32 * b), load_i32x16(corr, 32 * b))
    i1 = sub_i32x16(_half16(codes, 512 * b + 256, y, 32 * b + 16), load_i32x16(corr, 32 * b + 16))
    f = fma16(load_f32x16(scales, 32 * b + 16), to_f32x16(i1), mul16(load_f32x16(scales, 32 * b), to_f32x16(i0)))
    return fma16(f, f32x16(yd), acc)


def _gemm_rows(rows, tokens, block, zeros, store):
    """gemm_rows_q6k for `rows` rows (8: 256-bit vectors, 16: 512-bit), from that width's block
    function, accumulator and store; tiles of `tokens` (4 or 8) tokens, then of 4, then single ones.
    8 tokens on 512-bit vectors: each code vector loaded serves 8 vpdpbusd. The loop alone (no
    activation quantization), 1 thread, T = 512, three rounds, Gemma 3's 640x2048 and 1536x768:
    62-63% and 63-64% of the vpdpbusd peak with 4 tokens, 63-64% and 65% with 8. On AVX2's 16
    registers 8 accumulators would spill.

    The matrix's last rows (fewer than `rows`) are written to a scratch and copied: a store that
    checked the row count itself cost the loop 4-9% (1 thread, T = 512), last rows or not."""

    @numba.njit
    def gemm_rows(w, r0, y, xd, out):
        T, nb = xd.shape
        codes = np.empty(32 * rows * nb, np.uint8)
        scales = np.empty(2 * rows * nb, np.float32)
        corr = np.empty(2 * rows * nb, np.int32)
        _transcode_q6k(w, r0, rows, codes, scales, corr)
        whole = r0 + rows <= out.shape[1]
        dest = out if whole else np.empty((T, rows), np.float32)
        c0 = r0 if whole else 0
        t8 = T - T % 8 if tokens == 8 else 0
        t4 = T - T % 4
        if tokens == 8:
            for t in range(0, t8, 8):
                a0, a1, a2, a3 = zeros(), zeros(), zeros(), zeros()
                a4, a5, a6, a7 = zeros(), zeros(), zeros(), zeros()
                for b in range(nb):
                    a0 = block(codes, scales, corr, b, y[t], xd[t, b], a0)
                    a1 = block(codes, scales, corr, b, y[t + 1], xd[t + 1, b], a1)
                    a2 = block(codes, scales, corr, b, y[t + 2], xd[t + 2, b], a2)
                    a3 = block(codes, scales, corr, b, y[t + 3], xd[t + 3, b], a3)
                    a4 = block(codes, scales, corr, b, y[t + 4], xd[t + 4, b], a4)
                    a5 = block(codes, scales, corr, b, y[t + 5], xd[t + 5, b], a5)
                    a6 = block(codes, scales, corr, b, y[t + 6], xd[t + 6, b], a6)
                    a7 = block(codes, scales, corr, b, y[t + 7], xd[t + 7, b], a7)
                store(dest[t], c0, a0)
                store(dest[t + 1], c0, a1)
                store(dest[t + 2], c0, a2)
                store(dest[t + 3], c0, a3)
                store(dest[t + 4], c0, a4)
                store(dest[t + 5], c0, a5)
                store(dest[t + 6], c0, a6)
                store(dest[t + 7], c0, a7)
        for t in range(t8, t4, 4):
            y0, y1, y2, y3 = y[t], y[t + 1], y[t + 2], y[t + 3]
            a0, a1, a2, a3 = zeros(), zeros(), zeros(), zeros()
            for b in range(nb):
                a0 = block(codes, scales, corr, b, y0, xd[t, b], a0)
                a1 = block(codes, scales, corr, b, y1, xd[t + 1, b], a1)
                a2 = block(codes, scales, corr, b, y2, xd[t + 2, b], a2)
                a3 = block(codes, scales, corr, b, y3, xd[t + 3, b], a3)
            store(dest[t], c0, a0)
            store(dest[t + 1], c0, a1)
            store(dest[t + 2], c0, a2)
            store(dest[t + 3], c0, a3)
        for t in range(t4, T):
            acc = zeros()
            for b in range(nb):
                acc = block(codes, scales, corr, b, y[t], xd[t, b], acc)
            store(dest[t], c0, acc)
        if not whole:
            out[:, r0:] = dest[:, :out.shape[1] - r0]
    return gemm_rows


# out[:, r0 : r0+8] (16) for Q6_K rows r0.. of w: transcoded once, then 4 (8) tokens at a time. y: the
# activation codes + 128 as uint8 [T, n_cols], xd their block scales [T, n_cols/32].
gemm_rows_q6k = _gemm_rows(8, 4, _q6k_block, zeros_f32x8, store_f32x8)
gemm_rows_q6k16 = _gemm_rows(16, 8, _q6k_block16, zeros_f32x16, store_f32x16)


# --- T > 1 without VNNI: Q6_K's tiles three at a time ----------------------------------------
# The 8-row tiles above, through vpmaddubsw, spent a vpbroadcastd on every multiply and ran at
# 32-37% of the instruction's peak (1 thread, T = 512). As for the x8 types (interleaved.py, section
# "T > 1 without VNNI"), three tiles (24 rows) here share each activation quad, broadcast once per
# token and block into a register, and take their codes (- 32, signed) straight from a staging
# buffer as the multiply's memory operand. Each 16-bit lane starts from -128 x the sum of the 8
# codes it meets in a half block (4 chunks), made once per call, and so ends at sum y (c - 32) over
# its 8 values: within 8 x 127 x 32 = 32512, exact although the adds wrap on the way (each pair sum
# is within 2 x 255 x 32 = 16320). Those are _q6k_block's integers and its float ops follow, so
# every path gives the same bits (tests/quant/test_kquants.py, tests/core/test_isa.py).

Q6K_RECORD = 384  # staging bytes per block and tile: codes 256, lane corrections 2 x 32, scales 2 x 32
Q6K_CHUNK = 16  # blocks per pass over the tokens: 3 x 16 x 384 bytes = 18 KB of staging, in L1


@numba.njit
def _stage_q6k(w, r0, nb):
    """Rows r0 .. r0 + 23 of the Q6_K matrix w (rows past its end as zeros) as three tiles' records,
    uint8 [3 nb Q6K_RECORD], block b of tile k at Q6K_RECORD (3 b + k): _transcode_q6k's codes, the
    16-bit lanes' corrections of each half, and its two halves' scales."""
    buf = np.empty(3 * Q6K_RECORD * nb, np.uint8)
    codes = np.empty(256 * nb, np.uint8)
    scales = np.empty(16 * nb, np.float32)
    corr = np.empty(16 * nb, np.int32)  # the 32-bit corrections, unused here
    c128 = splat_u8(128)
    for k in range(3):
        _transcode_q6k(w, r0 + 8 * k, 8, codes, scales, corr)
        for b in range(nb):
            o = Q6K_RECORD * (3 * b + k)
            for h in range(2):
                c = 256 * b + 128 * h
                v = load_i8x32(codes, c)
                s = maddubs(c128, v)
                store_i8x32(buf, o + 128 * h, v)
                for n in range(1, 4):
                    v = load_i8x32(codes, c + 32 * n)
                    s = add_i16(s, maddubs(c128, v))
                    store_i8x32(buf, o + 128 * h + 32 * n, v)
                store_i16x16(buf, o + 256 + 32 * h, sub_i16(i16_halves(0, 0), s))
                store_f32x8(buf, o + 320 + 32 * h, load_f32x8(scales, 16 * b + 8 * h))
    return buf


@numba.njit
def _q6k_signed_block(q, buf, o, yd, acc):
    """acc + one tile's block at record o dotted with one activation block, q its 8 quads."""
    p0 = add_i16(load_i16x16(buf, o + 256), maddubs(q[0], load_i8x32(buf, o)))
    p1 = add_i16(load_i16x16(buf, o + 288), maddubs(q[4], load_i8x32(buf, o + 128)))
    for n in range(1, 4):
        p0 = add_i16(p0, maddubs(q[n], load_i8x32(buf, o + 32 * n)))
        p1 = add_i16(p1, maddubs(q[n + 4], load_i8x32(buf, o + 128 + 32 * n)))
    f = fma(load_f32x8(buf, o + 352), to_f32(sum_pairs(p1)), mul(load_f32x8(buf, o + 320), to_f32(sum_pairs(p0))))
    return fma(f, f32x8(yd), acc)


@numba.njit(cache=True)
def gemm_rows_q6k_triple(w, r0, y, xd, out):
    """out[:, r0 : r0 + 24] for rows r0.. of the Q6_K matrix w (section doc); y, xd as gemm_rows_q6k's."""
    T, nb = xd.shape
    buf = _stage_q6k(w, r0, nb)
    whole = r0 + 24 <= out.shape[1]
    dest = out if whole else np.empty((T, 24), np.float32)  # as in _gemm_rows
    c0 = r0 if whole else 0
    for b0 in range(0, nb, Q6K_CHUNK):
        for t in range(T):
            row, yt = dest[t], y[t]
            a0, a1, a2 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
            if b0 > 0:  # the partial sums of the blocks before this pass
                a0, a1, a2 = load_f32x8(row, c0), load_f32x8(row, c0 + 8), load_f32x8(row, c0 + 16)
            for b in range(b0, min(nb, b0 + Q6K_CHUNK)):
                yo, o = 32 * b, 3 * Q6K_RECORD * b
                q = (load_u8x4_bcast(yt, yo), load_u8x4_bcast(yt, yo + 4), load_u8x4_bcast(yt, yo + 8),
                     load_u8x4_bcast(yt, yo + 12), load_u8x4_bcast(yt, yo + 16), load_u8x4_bcast(yt, yo + 20),
                     load_u8x4_bcast(yt, yo + 24), load_u8x4_bcast(yt, yo + 28))
                a0 = _q6k_signed_block(q, buf, o, xd[t, b], a0)
                a1 = _q6k_signed_block(q, buf, o + Q6K_RECORD, xd[t, b], a1)
                a2 = _q6k_signed_block(q, buf, o + 2 * Q6K_RECORD, xd[t, b], a2)
            store_f32x8(row, c0, a0)
            store_f32x8(row, c0 + 8, a1)
            store_f32x8(row, c0 + 16, a2)
    if not whole:
        out[:, r0:] = dest[:, :out.shape[1] - r0]
