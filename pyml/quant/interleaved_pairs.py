"""The x8 layout's GEMM on 512-bit vectors (the avx512_vnni path): two groups side by side, lanes
0-7 group g and 8-15 group g + 1 (core/simd512.py), each half loaded from its own group with the
bytes unchanged: the same float ops per lane, so the same bits as the 256-bit loop
(interleaved_gemm.py), with twice the work per scheduler entry. The few-rows kernel pairs its
groups with the same code vectors and blocks (interleaved_rows.py's _rows_pair).
"""

from __future__ import annotations

import numba
import numpy as np

from pyml.core.simd import HAVE_VNNI
from pyml.core.simd512 import (add_i32x16, as_i8x64, dpbusd16, f32x16, fma16, fnma16, load_f32x16, load_fp16x8c_pair,
                               load_i32_bcast16, load_i32x8_pair, load_i8x4_bcast16, load_u8x32_pair,
                               load_u8x4_bcast16, load_u8x64, load_u8x8_f32_pair, mul16, mul16_fenced, nibbles_hi64,
                               nibbles_lo64, or_u8x64, splat_u8x64, store_f32x16, store_u8x64, sub_i32x16, to_f32x16,
                               zeros_f32x16, zeros_i32x16)
from pyml.core.simd_int import bit_to_u8
from pyml.quant.ggml_types import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0
from pyml.quant.interleaved import Q4_K_SUPERBLOCK
from pyml.quant.interleaved_gemv import _correction_table, _sb_size
from pyml.quant.interleaved_tiles import code_scratch, token_tiles


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
def _corrections16(kind, v):
    """_corrections of the two groups of _codes16's v side by side (I32x16): 128 x each row's code sum,
    Q8_0 on VNNI; zeros otherwise. The same integers, so the same bits (the few-rows kernel's pairs)."""
    numba.literally(kind)
    corr = zeros_i32x16()
    if kind == Q8_0 and HAVE_VNNI:
        c128 = splat_u8x64(128)
        for n in range(8):
            corr = dpbusd16(corr, c128, as_i8x64(v[n]))
    return corr


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
def _block_scales16(kind, w0, w1, o):
    """_block_scales of two groups side by side (F32x16)."""
    numba.literally(kind)
    d = load_fp16x8c_pair(w0, w1, o)
    if kind == Q4_1 or kind == Q5_1:
        return d, load_fp16x8c_pair(w0, w1, o + 16)
    return d, d


@numba.njit
def _block16(kind, v, corr, ws, y, b, yd, yoff, ys, acc):
    """_block on 16 rows (ws: _block_scales16; corr: the two groups' _corrections side by side, Q8_0)."""
    numba.literally(kind)
    scale = mul16(ws[0], f32x16(yd))
    i = _dot16(kind, v, y, 32 * b)
    if kind == Q8_0:
        i = sub_i32x16(i, corr)
    elif kind == Q4_0 or kind == Q5_0:
        i = sub_i32x16(i, load_i32_bcast16(yoff, b))
    acc = fma16(scale, to_f32x16(i), acc)
    if kind == Q4_1 or kind == Q5_1:
        acc = fma16(ws[1], f32x16(ys), acc)
    return acc


@numba.njit
def _block_codes16(kind, w0, w1, b):
    """_block_codes of two groups: _codes16 of superblock b, or for Q4_K _k_codes16 of its group b of 32."""
    numba.literally(kind)
    if kind == Q4_K:
        s, j = b // 8, b % 8
        c = Q4_K_SUPERBLOCK * s + 160 + 256 * (j // 2)
        return _k_codes16(w0, w1, c, 0) if j % 2 == 0 else _k_codes16(w0, w1, c, 1)
    return _codes16(kind, w0, w1, _sb_size(kind) * b)


_stage16, _staged16 = code_scratch(load_u8x64, store_u8x64, 64)


@numba.njit
def _staged_codes16(kind, w0, w1, nb):
    """_staged_codes of two groups on 512-bit vectors: uint8 [nb * 512], block b at 512 b."""
    numba.literally(kind)
    st = np.empty(512 * nb, np.uint8)
    for b in range(nb):
        _stage16(st, b, _block_codes16(kind, w0, w1, b))
    return st


@numba.njit
def _pair_corrections(kind, t0, t1, b):  # I32x16: rows b of two _correction_tables (zeros where empty)
    numba.literally(kind)
    if kind == Q8_0:
        return load_i32x8_pair(t0, t1, 8 * b)
    return zeros_i32x16()


@numba.njit
def _shared16(kind, data, b):  # _shared of interleaved_gemm on 16 rows (data: codes, both tables, both groups)
    return _staged16(data[0], b), _pair_corrections(kind, data[1], data[2], b)


@numba.njit
def _block_dot16(kind, data, s, b, y, yd, yoff, ys, acc):
    return _block16(kind, s[0], s[1], _block_scales16(kind, data[3], data[4], _sb_size(kind) * b), y, b, yd, yoff, ys,
                    acc)


@numba.njit
def _gemm_pair(kind, w0, w1, xq, xd, xs, xoff, out, g):
    """Rows 8g..8g+15 of out [T, R] from groups g (w0) and g + 1 (w1): _gemm_group on 16 rows."""
    numba.literally(kind)
    nb = xd.shape[1]
    data = (_staged_codes16(kind, w0, w1, nb), _correction_table(kind, w0, nb), _correction_table(kind, w1, nb), w0, w1)
    _tiles16(kind, data, xq, xd, xs, xoff, out, 8 * g)


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
def _k_scales16(w0, w1, u):
    """_k_scales of two groups side by side (F32x16 each), fenced as _k_scales."""
    o, j = Q4_K_SUPERBLOCK * (u // 8), u % 8
    return (mul16_fenced(load_fp16x8c_pair(w0, w1, o), load_u8x8_f32_pair(w0, w1, o + 32 + 8 * j)),
            mul16_fenced(load_fp16x8c_pair(w0, w1, o + 16), load_u8x8_f32_pair(w0, w1, o + 96 + 8 * j)))


@numba.njit
def _k_block16(v, ks, y, u, yd, ys, acc):
    """_k_block on 16 rows (ks: _k_scales16)."""
    acc = fma16(mul16(ks[0], f32x16(yd)), to_f32x16(_dot16(Q4_0, v, y, 32 * u)), acc)
    return fnma16(ks[1], f32x16(ys), acc)


@numba.njit
def _staged_scales16_k(w0, w1, n):
    """Q4_K, two groups: float32 [n * 32], group u of 32 values at 32 u: d x sc of the 16 rows, then
    dmin x mn. Made once per call, as the codes."""
    sc = np.empty(32 * n, np.float32)
    for u in range(n):
        d_sc, dmin_mn = _k_scales16(w0, w1, u)
        store_f32x16(sc, 32 * u, d_sc)
        store_f32x16(sc, 32 * u + 16, dmin_mn)
    return sc


@numba.njit
def _shared16_k(kind, data, u):  # Q4_K: group u's codes (data: codes, staged scales, both groups)
    return _staged16(data[0], u)


@numba.njit
def _block_dot16_k(kind, data, v, u, y, yd, yoff, ys, acc):
    """_k_block16, its scales from _staged_scales16_k."""
    sc = data[1]
    return _k_block16(v, (load_f32x16(sc, 32 * u), load_f32x16(sc, 32 * u + 16)), y, u, yd, ys, acc)


_tiles16 = token_tiles(zeros_f32x16, store_f32x16, _shared16, _block_dot16)
_tiles16_k = token_tiles(zeros_f32x16, store_f32x16, _shared16_k, _block_dot16_k)  # rows left: as the tiles


@numba.njit
def _gemm_pair_k(w0, w1, xq, xd, xs, xoff, out, g):
    """Q4_K: rows 8g..8g+15 of out [T, R] from groups g (w0) and g + 1 (w1)."""
    n = xd.shape[1]
    data = (_staged_codes16(Q4_K, w0, w1, n), _staged_scales16_k(w0, w1, n), w0, w1)
    _tiles16_k(Q4_K, data, xq, xd, xs, xoff, out, 8 * g)
