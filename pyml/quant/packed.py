"""The x8 layout: ggml's 4-bit blocks re-laid 8 rows at a time, so each instruction serves 8 rows.

Why: in the file's layout a GEMV spends ~14 instructions on every 32-value block of a row
(unpack the nibbles, one maddubs, convert and broadcast the block's scale, and a horizontal sum
per row at the end); on this machine Q4_0 ran at 13-20 GB/s where the memory gives ~30, so the
4-bit types decoded no faster than Q8_0 with twice their bytes. With 8 rows interleaved, one
32-byte load holds 4 codes of each of 8 rows; a maddubs against the 4 matching activation bytes,
broadcast, leaves each row's partial sums in that row's own lanes; the 8 rows' scales convert as
one vector, and no horizontal sum is left: ~6 instructions per row and block. Measured on
SmolLM2's shapes: the GEMV 2.5-3.1x, the GEMM (T = 128) 2.2-2.6x, from the same integer
arithmetic. llama.cpp repacks Q4_0 in the same spirit for its AVX2 kernels (block_q4_0x8).

Layout of a Q4_0 / Q4_1 matrix of R rows, nb blocks of 32 values per row (ts = 18 / 20 bytes):

    groups  uint8 [R // 8, nb * 8 * ts]: group g holds rows 8g..8g+7; block b of the group is a
            superblock of 8 * ts bytes at b * 8 * ts:
                d[8]          fp16, the scales of the 8 rows                    16 bytes
                m[8]          fp16, the mins of the 8 rows (Q4_1 only)           16 bytes
                qs[4][8][4]   chunk k: code bytes 4k..4k+3 of each of the 8 rows 128 bytes
            so code byte j of row r sits at 32 * (j // 4) + 4 * r + j % 4; as in the file, its low
            nibble is value j of the block and its high nibble value j + 16.
    tail    uint8 [R % 8, nb * ts]: the last rows, in the file's layout (the file kernels).

The integer dot of a superblock with an activation block y (int8 [32], activation.py):
    s      = sum over k of maddubs(chunk k & 15, y[4k:4k+4] in every quad)
                         + maddubs(chunk k >> 4, y[16+4k:20+4k] in every quad)
             each maddubs lane <= 2 * 15 * 127 = 3810 in magnitude, the 8 summed <= 30480 < 2^15
    dot_r  = sum_pairs(s)[r] = sum_j code_rj * y_j                     (I32x8, lane r = row r)
    Q4_0   value = d (code - 8):  y . w_r = d_r d_y (dot_r - 8 sum(y))
    Q4_1   value = d code + m:    y . w_r = d_r d_y dot_r + m_r s_y    (s_y = d_y sum(y))
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numba import prange

from pyml.quant.activation import quantize_q8, quantize_rows_q8
from pyml.quant.simd import (FASTMATH, add_i16, f32x8, fma, load_fp16x8c, load_i8x4_bcast, load_u8x32, maddubs,
                             mul, nibbles_hi, nibbles_lo, prefetch, store_f32x8, sub_i32, sum_pairs, to_f32,
                             zeros_f32x8)

# GGML type ids (compile-time constants in the kernels) -> bytes per block in the file
Q4_0, Q4_1 = 2, 3
TYPE_SIZE = {Q4_0: 18, Q4_1: 20}


@dataclass(frozen=True, eq=False)
class Packed:
    """A quantized matrix in the x8 layout; see the module doc. Made by pack(), read by pyml.quant."""

    kind: int             # GGML type id
    n_cols: int
    rows: int
    groups: np.ndarray    # uint8 [rows // 8, nb * 8 * type_size], read-only
    tail: np.ndarray      # uint8 [rows % 8, nb * type_size], read-only

    @property
    def nbytes(self) -> int:
        return self.groups.nbytes + self.tail.nbytes

    def unpack(self) -> np.ndarray:
        """The matrix in the file's layout, uint8 [rows, nb * type_size] (a copy: the exact path, tests)."""
        ts, nb, G = TYPE_SIZE[self.kind], self.n_cols // 32, self.groups.shape[0]
        head = ts - 16  # the fp16 fields before the codes: d (Q4_0), d and m (Q4_1)
        sb = self.groups.reshape(G, nb, 8 * ts)
        out = np.empty((self.rows, nb, ts), np.uint8)
        body = out[:8 * G].reshape(G, 8, nb, ts)
        for f in range(0, head, 2):
            body[..., f:f + 2] = sb[..., 8 * f:8 * f + 16].reshape(G, nb, 8, 2).transpose(0, 2, 1, 3)
        body[..., head:] = (sb[..., 8 * head:].reshape(G, nb, 4, 8, 4).transpose(0, 3, 1, 2, 4)
                            .reshape(G, 8, nb, 16))
        out[8 * G:] = self.tail.reshape(-1, nb, ts)
        return out.reshape(self.rows, nb * ts)


def pack(raw: np.ndarray, kind: int, n_cols: int) -> Packed:
    """raw uint8 [rows, nb * type_size] in the file's layout -> the x8 layout (one copy, numpy)."""
    ts, nb, G = TYPE_SIZE[kind], n_cols // 32, raw.shape[0] // 8
    head = ts - 16
    blocks = raw[:8 * G].reshape(G, 8, nb, ts)
    parts = [blocks[..., f:f + 2].transpose(0, 2, 1, 3).reshape(G, nb, 16) for f in range(0, head, 2)]
    parts.append(blocks[..., head:].reshape(G, 8, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, 128))
    groups = np.concatenate(parts, axis=2).reshape(G, nb * 8 * ts)
    tail = np.array(raw[8 * G:], dtype=np.uint8, order="C")
    groups.flags.writeable = tail.flags.writeable = False  # one array kind for the kernels
    return Packed(kind, n_cols, raw.shape[0], groups, tail)


# --- one superblock ----------------------------------------------------------------------

@numba.njit
def _codes(kind, w, o):
    """The 8 code vectors of the superblock at byte o: chunk k's low and high nibbles, k = 0..3."""
    numba.literally(kind)
    c = o + (16 if kind == Q4_0 else 32)
    v0, v1, v2, v3 = load_u8x32(w, c), load_u8x32(w, c + 32), load_u8x32(w, c + 64), load_u8x32(w, c + 96)
    return (nibbles_lo(v0), nibbles_hi(v0), nibbles_lo(v1), nibbles_hi(v1),
            nibbles_lo(v2), nibbles_hi(v2), nibbles_lo(v3), nibbles_hi(v3))


@numba.njit
def _dot(v, y, yo):  # I32x8, lane r = sum_j code_rj * y[yo + j]
    s = maddubs(v[0], load_i8x4_bcast(y, yo))
    s = add_i16(s, maddubs(v[1], load_i8x4_bcast(y, yo + 16)))
    s = add_i16(s, maddubs(v[2], load_i8x4_bcast(y, yo + 4)))
    s = add_i16(s, maddubs(v[3], load_i8x4_bcast(y, yo + 20)))
    s = add_i16(s, maddubs(v[4], load_i8x4_bcast(y, yo + 8)))
    s = add_i16(s, maddubs(v[5], load_i8x4_bcast(y, yo + 24)))
    s = add_i16(s, maddubs(v[6], load_i8x4_bcast(y, yo + 12)))
    s = add_i16(s, maddubs(v[7], load_i8x4_bcast(y, yo + 28)))
    return sum_pairs(s)


@numba.njit
def _block(kind, v, w, o, y, b, yd, ysum, ys, acc):
    """acc + the 8 rows' dot with activation block b (y int8, scale yd, code sum ysum, float sum ys)."""
    numba.literally(kind)
    scale = mul(load_fp16x8c(w, o), f32x8(yd))
    if kind == Q4_0:
        return fma(scale, to_f32(sub_i32(_dot(v, y, 32 * b), 8 * ysum)), acc)
    acc = fma(scale, to_f32(_dot(v, y, 32 * b)), acc)
    return fma(load_fp16x8c(w, o + 16), f32x8(ys), acc)


@numba.njit
def _code_sums(xq, nb):  # xq [nb*32] int8 -> int32 [nb]: each activation block's code sum
    s = np.empty(nb, np.int32)
    for b in range(nb):
        acc = 0
        for j in range(32):
            acc += xq[32 * b + j]
        s[b] = acc
    return s


# --- T == 1 --------------------------------------------------------------------------------

@numba.njit
def _gemv_group(kind, w, xq, xd, xs, xsum):  # F32x8: group w [nb * 8 * ts] . x, lane r = row r
    numba.literally(kind)
    sb = 8 * (18 if kind == Q4_0 else 20)
    acc = zeros_f32x8()
    for b in range(xd.size):
        o = sb * b
        prefetch(w, o + 1024)  # the streams of both threads stay ahead of their loads
        prefetch(w, o + 1088)
        acc = _block(kind, _codes(kind, w, o), w, o, xq, b, xd[b], xsum[b], xs[b], acc)
    return acc


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
def gemv(groups, x, out, kind):  # groups [G, nb*8*ts] u8, x [nb*32] f32 -> out [8G] f32
    xq, xd, xs, _ = quantize_q8(x)
    xsum = _code_sums(xq, xd.size)
    for g in prange(groups.shape[0]):
        if kind == Q4_0:
            store_f32x8(out, 8 * g, _gemv_group(Q4_0, groups[g], xq, xd, xs, xsum))
        else:
            store_f32x8(out, 8 * g, _gemv_group(Q4_1, groups[g], xq, xd, xs, xsum))
    return out


# --- T > 1 ---------------------------------------------------------------------------------

@numba.njit
def _gemm_group(kind, w, xq, xd, xs, xsum, out, g):
    """Rows 8g..8g+7 of out [T, R]: 4 activation rows at a time, each superblock unpacked once for them."""
    numba.literally(kind)
    sb = 8 * (18 if kind == Q4_0 else 20)
    T, nb = xd.shape
    for t in range(0, T - 3, 4):
        y0, y1, y2, y3 = xq[t], xq[t + 1], xq[t + 2], xq[t + 3]
        a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
        for b in range(nb):
            o = sb * b
            v = _codes(kind, w, o)
            a0 = _block(kind, v, w, o, y0, b, xd[t, b], xsum[t, b], xs[t, b], a0)
            a1 = _block(kind, v, w, o, y1, b, xd[t + 1, b], xsum[t + 1, b], xs[t + 1, b], a1)
            a2 = _block(kind, v, w, o, y2, b, xd[t + 2, b], xsum[t + 2, b], xs[t + 2, b], a2)
            a3 = _block(kind, v, w, o, y3, b, xd[t + 3, b], xsum[t + 3, b], xs[t + 3, b], a3)
        store_f32x8(out[t], 8 * g, a0)
        store_f32x8(out[t + 1], 8 * g, a1)
        store_f32x8(out[t + 2], 8 * g, a2)
        store_f32x8(out[t + 3], 8 * g, a3)
    for t in range(T - T % 4, T):
        acc = zeros_f32x8()
        for b in range(nb):
            o = sb * b
            acc = _block(kind, _codes(kind, w, o), w, o, xq[t], b, xd[t, b], xsum[t, b], xs[t, b], acc)
        store_f32x8(out[t], 8 * g, acc)


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
def gemm(groups, x, out, kind):  # groups [G, nb*8*ts] u8, x [T, nb*32] f32 -> out [T, R >= 8G] f32
    xq, xd, xs, _ = quantize_rows_q8(x)
    T, nb = xd.shape
    xsum = np.empty((T, nb), np.int32)
    for t in range(T):
        xsum[t] = _code_sums(xq[t], nb)
    for g in prange(groups.shape[0]):  # a group's weights stay in L1/L2 while the activations stream by
        if kind == Q4_0:
            _gemm_group(Q4_0, groups[g], xq, xd, xs, xsum, out, g)
        else:
            _gemm_group(Q4_1, groups[g], xq, xd, xs, xsum, out, g)
    return out
