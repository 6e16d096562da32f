"""Kernels for the low-bit types Q2_K, Q3_K (2-3 bit K-quants) and IQ4_NL, IQ4_XS (4-bit codes
through a non-linear table), with their block layouts and the KernelSet each type dispatches through.

Block layouts (ggml-common.h, QK_K = 256; little-endian; fp16 = IEEE half). Every type is read as
groups of 16 values, each with a float scale s and (Q2_K only) a float min m: value = s * code - m.

    Q2_K    84 bytes / 256  scales[16] | qs[64] | d:fp16 | dmin:fp16
            value e = 128 n + 32 j + l (n < 2, j < 4, l < 32): code (qs[32 n + l] >> 2 j) & 3;
            group g = e // 16: s = d * (scales[g] & 15), m = dmin * (scales[g] >> 4)
    Q3_K   110 bytes / 256  hmask[32] | qs[64] | scales[12] | d:fp16
            value e as Q2_K: code ((qs[32 n + l] >> 2 j) & 3) - 4, + 4 if bit (e // 32) of hmask[l] is set;
            6-bit signed scales: sc_g = (scales[g % 8] >> 4 (g // 8) & 15
                                         | (scales[8 + g % 4] >> 2 (g // 4) & 3) << 4) - 32,  s = d * sc_g
    IQ4_NL  18 bytes / 32   d:fp16 | qs[16]
            value l < 16: K[qs[l] & 15], value l + 16: K[qs[l] >> 4];  s = d for both groups
    IQ4_XS 136 bytes / 256  d:fp16 | scales_h:u16 | scales_l[4] | qs[128]
            sub-block i < 8 of 32 values: qs[16 i : 16 i + 16] as one IQ4_NL block's, with
            ls = (scales_l[i // 2] >> 4 (i % 2) & 15) | (scales_h >> 2 i & 3) << 4,  s = d * (ls - 32)
    K = kvalues_iq4nl = -127 -104 -83 -65 -49 -35 -22 -10 1 13 25 38 53 69 89 113

The int8 path dots each group's codes with the activation's int8 codes in integers (activation.py:
one float32 scale d_x per 32 values, as for every weight type), then one float multiply-add per
group: acc += d_x * (s * sum(code * q) - m * sum(q)); the Q2_K mins enter through the sum of the
activation codes, as ggml's q8_K bsums do. The exact path decodes a row and dots it with float32 x.

These loops are written as plain Numba loops over 16 values, which LLVM vectorises: no hand-laid
SIMD or interleaved layout yet (docs/models.md gives their speed beside llama.cpp's). For T > 1
each thread unpacks a row's codes to int8 once, then dots them with every token.
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np
from numba import prange

from pyml.core.simd import FASTMATH, load_fp16
from pyml.quant.activation import quantize_q8, quantize_rows_q8
from pyml.quant.ggml_types import BLOCK_SIZE, IQ4_NL, IQ4_XS, Q2_K, Q3_K, TYPE_SIZE
from pyml.quant.kernel_set import KernelSet, chunk_rows, n_chunks

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
LOWBIT_TYPES = (Q2_K, Q3_K, IQ4_NL, IQ4_XS)


@numba.njit(inline="always")
def _kvalue(nibble):
    return np.int32(KVALUES_IQ4NL[nibble])


@numba.njit(inline="always")
def _code(kind, w, o, e):
    """The integer code of value e (< block size) of the block at byte o of row w."""
    if kind == Q2_K:
        return np.int32((w[o + 16 + 32 * (e // 128) + e % 32] >> (2 * ((e // 32) % 4))) & 3)
    if kind == Q3_K:
        low = np.int32((w[o + 32 + 32 * (e // 128) + e % 32] >> (2 * ((e // 32) % 4))) & 3)
        high = np.int32((w[o + e % 32] >> (e // 32)) & 1)
        return low - 4 + 4 * high
    qs = o + (2 if kind == IQ4_NL else 8 + 16 * (e // 32))
    byte = w[qs + e % 16]
    return _kvalue(np.int32(byte & 15) if (e // 16) % 2 == 0 else np.int32(byte >> 4))


@numba.njit(inline="always")
def _scale_min(kind, w, o, g):
    """(s, m) float32 of group g (16 values) of the block at byte o of row w."""
    if kind == Q2_K:
        sc = w[o + g]
        return load_fp16(w, o + 80) * np.float32(sc & 15), load_fp16(w, o + 82) * np.float32(sc >> 4)
    if kind == Q3_K:
        low = (np.int32(w[o + 96 + g % 8]) >> (4 * (g // 8))) & 15
        high = (np.int32(w[o + 104 + g % 4]) >> (2 * (g // 4))) & 3
        return load_fp16(w, o + 108) * np.float32((low | (high << 4)) - 32), np.float32(0.0)
    if kind == IQ4_NL:
        return load_fp16(w, o), np.float32(0.0)
    i = g // 2
    scales_h = np.int32(w[o + 2]) | (np.int32(w[o + 3]) << 8)
    ls = ((np.int32(w[o + 4 + i // 2]) >> (4 * (i % 2))) & 15) | (((scales_h >> (2 * i)) & 3) << 4)
    return load_fp16(w, o) * np.float32(ls - 32), np.float32(0.0)


# --- decoding -------------------------------------------------------------------------------------

@numba.njit
def dequant_row(kind, w, y):  # w [nb * type_size] u8 -> y [nb * block] f32; gguf-py's float32 ops
    numba.literally(kind)
    bs, ts = BLOCK_SIZE[kind], TYPE_SIZE[kind]
    for b in range(y.size // bs):
        o = ts * b
        for g in range(bs // 16):
            s, m = _scale_min(kind, w, o, g)
            for k in range(16):
                e = 16 * g + k
                y[bs * b + e] = s * np.float32(_code(kind, w, o, e)) - m


# --- one row dotted with one activation row ----------------------------------------------------

@numba.njit(inline="always")
def _row_dot_q8(kind, w, xq, xd):
    """sum_e W[e] x[e] with x as int8 codes xq [n] and scales xd [n / 32]: integers per group."""
    bs, ts = BLOCK_SIZE[kind], TYPE_SIZE[kind]
    acc = np.float32(0.0)
    for b in range(xq.size // bs):
        o = ts * b
        for g in range(bs // 16):
            e0 = bs * b + 16 * g
            s, m = _scale_min(kind, w, o, g)
            isum = np.int32(0)
            xsum = np.int32(0)
            for k in range(16):
                q = np.int32(xq[e0 + k])
                isum += _code(kind, w, o, 16 * g + k) * q
                xsum += q
            acc += xd[e0 // 32] * (s * np.float32(isum) - m * np.float32(xsum))
    return acc


@numba.njit(inline="always")
def _row_dot_exact(kind, w, x, y):  # sum_e W[e] x[e], W's row decoded into the scratch y [n], float64 sums
    dequant_row(kind, w, y)
    acc = 0.0
    for e in range(x.size):
        acc += np.float64(y[e]) * np.float64(x[e])
    return np.float32(acc)


@numba.njit(inline="always")
def _unpack_row(kind, w, codes, s16, m16):
    """Row w's codes as int8 [n] and each group's (s, m) as float32 [n / 16]: for the GEMM, which
    reuses them for every token."""
    bs, ts = BLOCK_SIZE[kind], TYPE_SIZE[kind]
    for b in range(codes.size // bs):
        o = ts * b
        for g in range(bs // 16):
            s16[b * bs // 16 + g], m16[b * bs // 16 + g] = _scale_min(kind, w, o, g)
            for k in range(16):
                codes[bs * b + 16 * g + k] = _code(kind, w, o, 16 * g + k)


@numba.njit(inline="always")
def _unpacked_dot(codes, s16, m16, xq, xd):  # _row_dot_q8 over an unpacked row
    acc = np.float32(0.0)
    for g in range(s16.size):
        e0 = 16 * g
        isum = np.int32(0)
        xsum = np.int32(0)
        for k in range(16):
            q = np.int32(xq[e0 + k])
            isum += np.int32(codes[e0 + k]) * q
            xsum += q
        acc += xd[g // 2] * (s16[g] * np.float32(isum) - m16[g] * np.float32(xsum))
    return acc


@lru_cache(maxsize=None)
def lowbit_kernels(kind: int) -> KernelSet:
    """The KernelSet (kernel_set.py) of a low-bit type; w [R, row_bytes] uint8, kind a constant."""
    kind = int(kind)  # a plain int: Numba types a captured int as a constant, an IntEnum not
    if kind not in LOWBIT_TYPES:
        raise ValueError(f"lowbit.py has no kernels for ggml type {kind}")

    @numba.njit(cache=True)
    def dequant_rows(raw, row_ids, out):  # raw [R, row_bytes], row_ids [n] -> out [n, n_cols] f32
        for i in range(row_ids.size):
            dequant_row(kind, raw[row_ids[i]], out[i])
        return out

    @numba.njit(cache=True)
    def dequant_tile(raw, r0, out):  # out [n, n_cols] f32 <- rows r0 .. r0 + n of raw
        for i in range(out.shape[0]):
            dequant_row(kind, raw[r0 + i], out[i])
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemv(w, x, out):  # w [R, row_bytes], x [n_cols] f32 -> out [R] f32
        xq, xd, xs, xp = quantize_q8(x)
        for r in prange(w.shape[0]):
            out[r] = _row_dot_q8(kind, w[r], xq, xd)
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemv_rows(w, x, out):  # w [R, row_bytes], x [T, n_cols] f32 -> out [T, R] f32, each row as gemv's
        xq, xd, xs, xp = quantize_rows_q8(x)  # each row as quantize_q8 quantizes it alone
        for r in prange(w.shape[0]):  # a weight row stays in L1 while every activation row takes it
            for t in range(x.shape[0]):
                out[t, r] = _row_dot_q8(kind, w[r], xq[t], xd[t])
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemv_exact(w, x, out):  # w [R, row_bytes], x [n_cols] f32 -> out [R] f32
        for r in prange(w.shape[0]):  # tests and debugging only: a scratch row per row is fine
            out[r] = _row_dot_exact(kind, w[r], x, np.empty(x.size, np.float32))
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemm(w, x, out):  # w [R, row_bytes], x [T, n_cols] f32 -> out [T, R] f32
        xq, xd, xs, xp = quantize_rows_q8(x)
        n_cols = x.shape[1]
        for c in prange(n_chunks(w.shape[0])):
            r_lo, r_hi = chunk_rows(c, w.shape[0])
            codes = np.empty(n_cols, np.int8)
            s16 = np.empty(n_cols // 16, np.float32)
            m16 = np.empty(n_cols // 16, np.float32)
            for r in range(r_lo, r_hi):
                _unpack_row(kind, w[r], codes, s16, m16)
                for t in range(x.shape[0]):
                    out[t, r] = _unpacked_dot(codes, s16, m16, xq[t], xd[t])
        return out

    return KernelSet(dequant_rows, dequant_tile, gemv, gemv_exact, gemm, gemv_rows)
