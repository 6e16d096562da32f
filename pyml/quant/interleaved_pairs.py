"""The x8 layout's GEMM on 512-bit vectors (the avx512_vnni path): two groups side by side, lanes
0-7 group g and 8-15 group g + 1 (core/simd512.py), each half loaded from its own group with the
bytes unchanged: the same float ops per lane, so the same bits as the 256-bit loop
(interleaved_gemm.py), with twice the work per scheduler entry.
"""

from __future__ import annotations

import numba
import numpy as np

from pyml.core.simd import store_f32x8
from pyml.core.simd512 import (add_i32x16, as_i8x64, dpbusd16, f32x16, fma16, fnma16, load_f32x16, load_fp16x8c_pair,
                               load_i32_bcast16, load_i32x8_pair, load_i8x4_bcast16, load_u8x32_pair,
                               load_u8x4_bcast16, load_u8x64, load_u8x8_f32_pair, mul16, nibbles_hi64, nibbles_lo64,
                               or_u8x64, store_f32x16, store_u8x64, sub_i32x16, to_f32x16, zeros_f32x16, zeros_i32x16)
from pyml.core.simd_int import bit_to_u8
from pyml.quant.ggml_types import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0
from pyml.quant.interleaved import Q4_K_SUPERBLOCK
from pyml.quant.interleaved_gemv import _correction_table, _gemv_group_k, _sb_size


ZMM_KINDS = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K)  # the types whose GEMM runs on 512-bit vectors (avx512_vnni)


@numba.njit
def _codes16(kind, w0, w1, o):
    """_codes of superblock o of two groups: lanes 0-31 of each vector group w0's, 32-63 group w1's."""
    numba.literally(kind)
    if kind == Q8_0:
        c = o + 16
        return (load_u8x32_pair(w0, w1, c), load_u8x32_pair(w0, w1, c + 32), load_u8x32_pair(w0, w1, c + 64),
                load_u8x32_pair(w0, w1, c + 96), load_u8x32_pair(w0, w1, c + 128), load_u8x32_pair(w0, w1, c + 160),
                load_u8x32_pair(w0, w1, c + 192), load_u8x32_pair(w0, w1, c + 224))
    c = o + (32 if kind == Q4_1 else 48 if kind == Q5_0 else 64 if kind == Q5_1 else 16)
    v0, v1 = load_u8x32_pair(w0, w1, c), load_u8x32_pair(w0, w1, c + 32)
    v2, v3 = load_u8x32_pair(w0, w1, c + 64), load_u8x32_pair(w0, w1, c + 96)
    n = (nibbles_lo64(v0), nibbles_hi64(v0), nibbles_lo64(v1), nibbles_hi64(v1),
         nibbles_lo64(v2), nibbles_hi64(v2), nibbles_lo64(v3), nibbles_hi64(v3))
    if kind == Q4_0 or kind == Q4_1:
        return n
    h = load_u8x32_pair(w0, w1, c - 32)  # Q5: the fifth bits, as _codes
    return (or_u8x64(n[0], bit_to_u8(h, 0, 16)), or_u8x64(n[1], bit_to_u8(h, 1, 16)),
            or_u8x64(n[2], bit_to_u8(h, 2, 16)), or_u8x64(n[3], bit_to_u8(h, 3, 16)),
            or_u8x64(n[4], bit_to_u8(h, 4, 16)), or_u8x64(n[5], bit_to_u8(h, 5, 16)),
            or_u8x64(n[6], bit_to_u8(h, 6, 16)), or_u8x64(n[7], bit_to_u8(h, 7, 16)))


@numba.njit
def _dot16(kind, v, y, yo):
    """_dot_vnni on 16 rows: I32x16, lane r = row r's integer dot (Q8_0: before its correction)."""
    numba.literally(kind)
    acc, acc2 = zeros_i32x16(), zeros_i32x16()
    if kind == Q8_0:
        for n in range(0, 8, 2):
            acc = dpbusd16(acc, load_u8x4_bcast16(y, yo + 4 * n), as_i8x64(v[n]))
            acc2 = dpbusd16(acc2, load_u8x4_bcast16(y, yo + 4 * n + 4), as_i8x64(v[n + 1]))
    else:
        for n in range(0, 8, 2):
            acc = dpbusd16(acc, v[n], load_i8x4_bcast16(y, yo + 2 * n))
            acc2 = dpbusd16(acc2, v[n + 1], load_i8x4_bcast16(y, yo + 16 + 2 * n))
    return add_i32x16(acc, acc2)


@numba.njit
def _block16(kind, v, corr, w0, w1, o, y, b, yd, yoff, ys, acc):
    """_block on 16 rows (corr: the two groups' _corrections side by side, Q8_0)."""
    numba.literally(kind)
    scale = mul16(load_fp16x8c_pair(w0, w1, o), f32x16(yd))
    i = _dot16(kind, v, y, 32 * b)
    if kind == Q8_0:
        i = sub_i32x16(i, corr)
    elif kind == Q4_0 or kind == Q5_0:
        i = sub_i32x16(i, load_i32_bcast16(yoff, b))
    acc = fma16(scale, to_f32x16(i), acc)
    if kind == Q4_1 or kind == Q5_1:
        acc = fma16(load_fp16x8c_pair(w0, w1, o + 16), f32x16(ys), acc)
    return acc


@numba.njit
def _staged_codes16(kind, w0, w1, nb):
    """_staged_codes of two groups on 512-bit vectors: uint8 [nb * 512], block b at 512 b."""
    numba.literally(kind)
    st = np.empty(512 * nb, np.uint8)
    for b in range(nb):
        if kind == Q4_K:
            s, j = b // 8, b % 8
            c = Q4_K_SUPERBLOCK * s + 160 + 256 * (j // 2)
            v = _k_codes16(w0, w1, c, 0) if j % 2 == 0 else _k_codes16(w0, w1, c, 1)
        else:
            v = _codes16(kind, w0, w1, _sb_size(kind) * b)
        for n in range(8):
            store_u8x64(st, 512 * b + 64 * n, v[n])
    return st


@numba.njit
def _staged16(st, b):  # the 8 code vectors of block b of _staged_codes16
    c = 512 * b
    return (load_u8x64(st, c), load_u8x64(st, c + 64), load_u8x64(st, c + 128), load_u8x64(st, c + 192),
            load_u8x64(st, c + 256), load_u8x64(st, c + 320), load_u8x64(st, c + 384), load_u8x64(st, c + 448))


@numba.njit
def _pair_corrections(kind, t0, t1, b):  # I32x16: rows b of two _correction_tables (zeros where empty)
    numba.literally(kind)
    if kind == Q8_0:
        return load_i32x8_pair(t0, t1, 8 * b)
    return zeros_i32x16()


@numba.njit
def _gemm_pair(kind, w0, w1, xq, xd, xs, xoff, out, g):
    """Rows 8g..8g+15 of out [T, R] from groups g (w0) and g + 1 (w1): _gemm_group on 16 rows."""
    numba.literally(kind)
    sb = _sb_size(kind)
    T, nb = xd.shape
    t0, t1 = _correction_table(kind, w0, nb), _correction_table(kind, w1, nb)
    st = _staged_codes16(kind, w0, w1, nb)
    for t in range(0, T - 3, 4):
        y0, y1, y2, y3 = xq[t], xq[t + 1], xq[t + 2], xq[t + 3]
        f0, f1, f2, f3 = xoff[t], xoff[t + 1], xoff[t + 2], xoff[t + 3]
        a0, a1, a2, a3 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
        for b in range(nb):
            o = sb * b
            v = _staged16(st, b)
            corr = _pair_corrections(kind, t0, t1, b)
            a0 = _block16(kind, v, corr, w0, w1, o, y0, b, xd[t, b], f0, xs[t, b], a0)
            a1 = _block16(kind, v, corr, w0, w1, o, y1, b, xd[t + 1, b], f1, xs[t + 1, b], a1)
            a2 = _block16(kind, v, corr, w0, w1, o, y2, b, xd[t + 2, b], f2, xs[t + 2, b], a2)
            a3 = _block16(kind, v, corr, w0, w1, o, y3, b, xd[t + 3, b], f3, xs[t + 3, b], a3)
        store_f32x16(out[t], 8 * g, a0)
        store_f32x16(out[t + 1], 8 * g, a1)
        store_f32x16(out[t + 2], 8 * g, a2)
        store_f32x16(out[t + 3], 8 * g, a3)
    for t in range(T - T % 4, T):
        acc = zeros_f32x16()
        for b in range(nb):
            o = sb * b
            acc = _block16(kind, _staged16(st, b), _pair_corrections(kind, t0, t1, b), w0, w1, o, xq[t], b,
                           xd[t, b], xoff[t], xs[t, b], acc)
        store_f32x16(out[t], 8 * g, acc)


@numba.njit
def _k_codes16(w0, w1, c, half):
    """_k_codes of two groups (16 rows)."""
    numba.literally(half)
    v0, v1 = load_u8x32_pair(w0, w1, c), load_u8x32_pair(w0, w1, c + 128)
    v2, v3 = load_u8x32_pair(w0, w1, c + 32), load_u8x32_pair(w0, w1, c + 160)
    v4, v5 = load_u8x32_pair(w0, w1, c + 64), load_u8x32_pair(w0, w1, c + 192)
    v6, v7 = load_u8x32_pair(w0, w1, c + 96), load_u8x32_pair(w0, w1, c + 224)
    if half == 0:
        return (nibbles_lo64(v0), nibbles_lo64(v1), nibbles_lo64(v2), nibbles_lo64(v3),
                nibbles_lo64(v4), nibbles_lo64(v5), nibbles_lo64(v6), nibbles_lo64(v7))
    return (nibbles_hi64(v0), nibbles_hi64(v1), nibbles_hi64(v2), nibbles_hi64(v3),
            nibbles_hi64(v4), nibbles_hi64(v5), nibbles_hi64(v6), nibbles_hi64(v7))


@numba.njit
def _staged_scales16_k(w0, w1, n):
    """Q4_K, two groups: float32 [n * 32], group u of 32 values at 32 u: d x sc of the 16 rows, then
    dmin x mn. Made once per call, as the codes: _k_block16 converted and multiplied them per token tile."""
    sc = np.empty(32 * n, np.float32)
    for u in range(n):
        o, j = Q4_K_SUPERBLOCK * (u // 8), u % 8
        store_f32x16(sc, 32 * u, mul16(load_fp16x8c_pair(w0, w1, o), load_u8x8_f32_pair(w0, w1, o + 32 + 8 * j)))
        store_f32x16(sc, 32 * u + 16, mul16(load_fp16x8c_pair(w0, w1, o + 16),
                                            load_u8x8_f32_pair(w0, w1, o + 96 + 8 * j)))
    return sc


@numba.njit
def _k_block16s(v, sc, u, y, yd, ys, acc):
    """_k_block_s on 16 rows."""
    acc = fma16(mul16(load_f32x16(sc, 32 * u), f32x16(yd)), to_f32x16(_dot16(Q4_0, v, y, 32 * u)), acc)
    return fnma16(load_f32x16(sc, 32 * u + 16), f32x16(ys), acc)


@numba.njit
def _gemm_pair_k(w0, w1, xq, xd, xs, out, g):
    """Q4_K: rows 8g..8g+15 of out [T, R] from groups g (w0) and g + 1 (w1)."""
    T, n = xd.shape
    st, sc = _staged_codes16(Q4_K, w0, w1, n), _staged_scales16_k(w0, w1, n)
    for t in range(0, T - 3, 4):
        y0, y1, y2, y3 = xq[t], xq[t + 1], xq[t + 2], xq[t + 3]
        a0, a1, a2, a3 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
        for u in range(n):
            v = _staged16(st, u)
            a0 = _k_block16s(v, sc, u, y0, xd[t, u], xs[t, u], a0)
            a1 = _k_block16s(v, sc, u, y1, xd[t + 1, u], xs[t + 1, u], a1)
            a2 = _k_block16s(v, sc, u, y2, xd[t + 2, u], xs[t + 2, u], a2)
            a3 = _k_block16s(v, sc, u, y3, xd[t + 3, u], xs[t + 3, u], a3)
        store_f32x16(out[t], 8 * g, a0)
        store_f32x16(out[t + 1], 8 * g, a1)
        store_f32x16(out[t + 2], 8 * g, a2)
        store_f32x16(out[t + 3], 8 * g, a3)
    for t in range(T - T % 4, T):
        store_f32x8(out[t], 8 * g, _gemv_group_k(w0, xq[t], xd[t], xs[t]))
        store_f32x8(out[t], 8 * g + 8, _gemv_group_k(w1, xq[t], xd[t], xs[t]))
