"""Float weights: F32, F16 and BF16 matrices (rows, n_cols), converted to float32 on the fly.

Storage: float32; float16 (passed to the kernels as its uint16 bits: Numba has no float16);
uint16 holding bfloat16 bits (the top half of a float32). T == 1 runs a GEMV that streams the
weights once (F16/BF16 at 2 bytes per weight); T > 1 a GEMM in register tiles of 4 weight rows
x 4 activation rows, each weight vector widened to float32 once per tile (vcvtph2ps for F16, a
shift for BF16). For T >= PANEL_MIN_T each thread packs weight rows column-major and runs tiles of
6 tokens x 16 rows on ymm where the code has 16 vector registers, as BLIS does on AVX2, and of 8
tokens x 32 rows on zmm on the avx512 paths (section "T > 1 in packed panels"); fewer tokens run
a 3 x 3 tile (16 registers) or the 4 x 4 one. All are exact up to float32 summation order.
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np
from numba import prange

from pyml.core.isa import REGISTERS, ZMM
from pyml.quant.ggml_types import F16, F32
from pyml.quant.kernel_set import KernelSet, chunk_rows, n_chunks
from pyml.core.simd import (FASTMATH, add, bf16_to_f32, f32x8, fma, half_to_f32, hsum, load_bf16x8, load_f16x8,
                            load_f32x8, prefetch, store_f32x8, transpose_u32, zeros_f32x8)
from pyml.core.simd512 import f32x16, fma16, load_f32x16, store_f32x16



@numba.njit
def _load8(kind, w, i):  # 8 weights from index i as F32x8
    numba.literally(kind)
    if kind == F32:
        return load_f32x8(w, i)
    if kind == F16:
        return load_f16x8(w, i)
    return load_bf16x8(w, i)


@numba.njit
def _scalar(kind, v):  # one stored weight as float32
    numba.literally(kind)
    if kind == F32:
        return np.float32(v)
    if kind == F16:
        return half_to_f32(v)
    return bf16_to_f32(v)


@numba.njit
def _gemv_row(kind, w, x):  # w [n] . x [n], 32 weights per step in 4 accumulators
    numba.literally(kind)
    n = x.size
    a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    for i in range(n // 32):
        k = 32 * i
        prefetch(w, k + 1024)  # ~2-4 KB ahead: the hardware prefetcher alone leaves gaps
        if kind == F32:
            prefetch(w, k + 1024 + 16)
        a0 = fma(_load8(kind, w, k), load_f32x8(x, k), a0)
        a1 = fma(_load8(kind, w, k + 8), load_f32x8(x, k + 8), a1)
        a2 = fma(_load8(kind, w, k + 16), load_f32x8(x, k + 16), a2)
        a3 = fma(_load8(kind, w, k + 24), load_f32x8(x, k + 24), a3)
    s = hsum(add(add(a0, a1), add(a2, a3)))
    for k in range(n - n % 32, n):  # the tail: row lengths need not be multiples of 32
        s += _scalar(kind, w[k]) * x[k]
    return s


def to_f32(w: np.ndarray, kind: int) -> np.ndarray:
    """A float32 copy of stored float weights (any shape)."""
    if kind == F32:
        return np.array(w, dtype=np.float32)
    if kind == F16:
        return w.view(np.float16).astype(np.float32)
    return (w.astype(np.uint32) << 16).view(np.float32)


# --- T > 1 -----------------------------------------------------------------------------------

@numba.njit
def _tile4(kind, w, r, x, t):
    """16 dot products: weight rows r[0..3] x activation rows t[0..3], 8 columns per step; each
    weight vector is loaded (and widened to float32) once for the 4 activation rows, each
    activation vector once for the 4 weight rows: 8 loads per 16 FMAs, 16 independent
    accumulators, 24 live vectors: for 32 registers (AVX-512). Measured, 1 thread, T = 128 on
    SmolLM2's shapes: 91-109 GFLOP/s against 53-90 for the 2 x 4 tile it replaced."""
    numba.literally(kind)
    w0, w1, w2, w3 = w[r[0]], w[r[1]], w[r[2]], w[r[3]]
    xa, xb, xc, xd = x[t[0]], x[t[1]], x[t[2]], x[t[3]]
    a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    b0, b1, b2, b3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    c0, c1, c2, c3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    d0, d1, d2, d3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    for i in range(x.shape[1] // 8):
        k = 8 * i
        v0, v1, v2, v3 = _load8(kind, w0, k), _load8(kind, w1, k), _load8(kind, w2, k), _load8(kind, w3, k)
        y = load_f32x8(xa, k)
        a0, a1, a2, a3 = fma(v0, y, a0), fma(v1, y, a1), fma(v2, y, a2), fma(v3, y, a3)
        y = load_f32x8(xb, k)
        b0, b1, b2, b3 = fma(v0, y, b0), fma(v1, y, b1), fma(v2, y, b2), fma(v3, y, b3)
        y = load_f32x8(xc, k)
        c0, c1, c2, c3 = fma(v0, y, c0), fma(v1, y, c1), fma(v2, y, c2), fma(v3, y, c3)
        y = load_f32x8(xd, k)
        d0, d1, d2, d3 = fma(v0, y, d0), fma(v1, y, d1), fma(v2, y, d2), fma(v3, y, d3)
    return ((a0, a1, a2, a3), (b0, b1, b2, b3), (c0, c1, c2, c3), (d0, d1, d2, d3))


@numba.njit
def _tile3(kind, w, r, x, t):
    """_tile4 for 16 registers (AVX2 without AVX-512): 3 weight rows x 3 activation rows, 9
    accumulators and 6 operands, 6 loads per 9 FMAs. The 4 x 4 tile needs 24 live vectors; compiled
    for 16 registers it spilled accumulators every step. 1 thread, T = 512, SmolLM2's shapes, on
    the avx2 path compiled as for an AVX2-only CPU (core/isa.py): F32 42-46% -> 66-68% of the
    float32 FMA peak, F16 38-43% -> 71-80%. With 32 registers the 4 x 4 tile stays ahead (74-88%
    against 62-80%)."""
    numba.literally(kind)
    w0, w1, w2 = w[r[0]], w[r[1]], w[r[2]]
    xa, xb, xc = x[t[0]], x[t[1]], x[t[2]]
    a0, a1, a2 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    b0, b1, b2 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    c0, c1, c2 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    for i in range(x.shape[1] // 8):
        k = 8 * i
        v0, v1, v2 = _load8(kind, w0, k), _load8(kind, w1, k), _load8(kind, w2, k)
        y = load_f32x8(xa, k)
        a0, a1, a2 = fma(v0, y, a0), fma(v1, y, a1), fma(v2, y, a2)
        y = load_f32x8(xb, k)
        b0, b1, b2 = fma(v0, y, b0), fma(v1, y, b1), fma(v2, y, b2)
        y = load_f32x8(xc, k)
        c0, c1, c2 = fma(v0, y, c0), fma(v1, y, c1), fma(v2, y, c2)
    return ((a0, a1, a2), (b0, b1, b2), (c0, c1, c2))


@numba.njit
def _span4(i0, end):  # the tile's 4 indices from i0, the last repeated past end
    return (i0, min(i0 + 1, end - 1), min(i0 + 2, end - 1), min(i0 + 3, end - 1))


@numba.njit
def _span3(i0, end):
    return (i0, min(i0 + 1, end - 1), min(i0 + 2, end - 1))


# the tile the compiled code's registers hold (core/isa.py: REGISTERS)
TILE = 4 if REGISTERS == 32 else 3
_tile, _span = (_tile4, _span4) if TILE == 4 else (_tile3, _span3)


@numba.njit
def _gemm_chunk(kind, w, x, out, r_lo, r_hi):
    """Rows r_lo..r_hi of out [T, R] in TILE x TILE register tiles, activation tiles outside, so the
    chunk's weights stay in L1/L2. Tiles at the edges repeat their last row (computed twice,
    stored once)."""
    numba.literally(kind)
    T, n = x.shape
    for t0 in range(0, T, TILE):
        t = _span(t0, T)
        for r0 in range(r_lo, r_hi, TILE):
            r = _span(r0, r_hi)
            acc = _tile(kind, w, r, x, t)
            for i in range(TILE):
                if t0 + i < T:
                    for j in range(TILE):
                        if r0 + j < r_hi:
                            s = hsum(acc[i][j])
                            for c in range(n - n % 8, n):  # the tail: rows need not be multiples of 8
                                s += _scalar(kind, w[r[j], c]) * x[t[i], c]
                            out[t[i], r[j]] = s


# --- T > 1 in packed panels: 16 rows on ymm, 32 on zmm ----------------------------------------
# With 16 registers the dot-product tile above holds 3 x 3 sums: 6 loads per 9 FMAs, a weight
# vector widened once per 3 tokens, and a horizontal sum per output: 57-76% of the float32 FMA
# peak (kernel_bench, AVX2, 1 thread, T = 512). The AVX2 micro-kernels of BLIS and OpenBLAS turn
# the product round: each thread packs 16 weight rows at a time column-major as float32 (F16/BF16
# widened once per call), and a tile of 6 tokens x 16 rows keeps 12 accumulators, each column k
# feeding 12 FMAs from 2 panel loads and 6 broadcasts of x[t, k]: 15 registers, no horizontal
# sums; 79-83%. The tokens pass over PANEL_K columns at a time (16 KB of panel, in L1), the sums
# held in a per-panel scratch. Summed in column order (not in 8 lanes), so the float32 rounding
# differs from the other tiles' (within the same bound: tests/quant/test_floats.py).

PANEL = 16  # weight rows per panel: two 8-lane vectors
PANEL_T = 6  # tokens per tile
PANEL_K = 256  # columns per pass over the tokens
# Packing costs about what 30-60 tokens gain (a 6-token tile also pads T up to a multiple of 6):
# kernel_bench (1 thread, avx2) at T = 8 read 29-33% of the peak against 51-68% for the 3 x 3
# tile, at T = 32 55-65% against 49-74%, at T = 64 52-74% against 45-68%, at T = 512 79-83%
# against 57-76%. On zmm (32 rows x 8 tokens, avx512_bf16 path) at T = 64: 73-83% against 65-88%
# for the 4 x 4 tile, the same within the host's noise.
PANEL_MIN_T = 64


@numba.njit(cache=True)
def _pack_panel(kind, w, r0, r_hi, panel):
    """panel uint8 [64 Kp] <- rows r0 .. r0 + 15 of w as float32, column-major: column k's 16 floats
    at byte 64 k (rows from r_hi on, and columns past the row's end up to Kp = its length rounded
    up to 16: zeros)."""
    numba.literally(kind)
    K = w.shape[1]
    stage = np.empty(1024, np.uint8)  # 16 rows x 16 columns, then transposed as 4-byte words
    edge = np.empty(16, np.float32)
    for k0 in range(0, K, 16):
        for j in range(16):
            r = r0 + j
            if r < r_hi and k0 + 16 <= K:
                store_f32x8(stage, 64 * j, _load8(kind, w[r], k0))
                store_f32x8(stage, 64 * j + 32, _load8(kind, w[r], k0 + 8))
            else:
                for c in range(16):
                    edge[c] = _scalar(kind, w[r, k0 + c]) if r < r_hi and k0 + c < K else np.float32(0.0)
                store_f32x8(stage, 64 * j, load_f32x8(edge, 0))
                store_f32x8(stage, 64 * j + 32, load_f32x8(edge, 8))
        transpose_u32(stage, 0, 64, panel, 64 * k0, 16)


def _pair_ops(load, store, splat, fma_pair, lanes):
    """A panel tile's per-token helpers for rows held in two vectors of `lanes` floats: load a
    token's sums, add s x the panel pair to them, store them."""
    @numba.njit
    def row2(acc, t):
        return load(acc[t], 0), load(acc[t], lanes)

    @numba.njit
    def fma2(p, s, a):
        y = splat(s)
        return fma_pair(p[0], y, a[0]), fma_pair(p[1], y, a[1])

    @numba.njit
    def store2(acc, t, a):
        store(acc[t], 0, a[0])
        store(acc[t], lanes, a[1])
    return row2, fma2, store2


_row2, _fma2, _store2 = _pair_ops(load_f32x8, store_f32x8, f32x8, fma, 8)


@numba.njit
def _panel_tile(panel, x, t0, k0, k1, acc):
    """acc[t0 .. t0 + 5] (float32 [*, 16]) += x[t0 .. t0 + 5, k0:k1] @ the panel's columns k0:k1
    (tokens past x's last: its last again, into acc rows past T)."""
    T = x.shape[0]
    xa, xb, xc = x[t0], x[min(t0 + 1, T - 1)], x[min(t0 + 2, T - 1)]
    xd, xe, xf = x[min(t0 + 3, T - 1)], x[min(t0 + 4, T - 1)], x[min(t0 + 5, T - 1)]
    a, b, c = _row2(acc, t0), _row2(acc, t0 + 1), _row2(acc, t0 + 2)
    d, e, f = _row2(acc, t0 + 3), _row2(acc, t0 + 4), _row2(acc, t0 + 5)
    for k in range(k0, k1):
        p = load_f32x8(panel, 64 * k), load_f32x8(panel, 64 * k + 32)
        a, b, c = _fma2(p, xa[k], a), _fma2(p, xb[k], b), _fma2(p, xc[k], c)
        d, e, f = _fma2(p, xd[k], d), _fma2(p, xe[k], e), _fma2(p, xf[k], f)
    _store2(acc, t0, a)
    _store2(acc, t0 + 1, b)
    _store2(acc, t0 + 2, c)
    _store2(acc, t0 + 3, d)
    _store2(acc, t0 + 4, e)
    _store2(acc, t0 + 5, f)


# With 512-bit vectors (the avx512 paths: 32 registers) the panels hold 32 rows, two 16-row halves
# of the layout above, and a tile is 8 tokens x 32 rows on zmm: 16 accumulators, and per column 2
# panel loads and 8 broadcasts for 16 FMAs, 26 registers. (12 tokens, BLIS's skx shape, needs 24
# accumulators beside the broadcasts, which LLVM keeps in registers rather than as the FMAs'
# {1to16} operands: it spilled, 58-70% of the peak.) On Zen 4, which splits a 512-bit FMA in two,
# the 4 x 4 ymm tile was already near the peak: kernel_bench (1 thread, T = 512, old and new builds
# alternating) F32 63-82% -> 82-89%, F16 83-88% -> 82-89%. On CPUs with two 512-bit FMA units
# (Intel's server cores) a ymm tile can reach only half the zmm peak, which kernel_bench now measures.
PANEL_Z = 32
PANEL_TZ = 8


_row2z, _fma2z, _store2z = _pair_ops(load_f32x16, store_f32x16, f32x16, fma16, 16)


@numba.njit
def _panel_tile_z(panel, half, x, t0, k0, k1, acc):
    """_panel_tile on zmm: acc[t0 .. t0 + 7] (float32 [*, 32]) += x[t0 .. t0 + 7, k0:k1] @ columns
    k0:k1 of the panel, rows 0-15 from byte 0 and rows 16-31 from byte `half`."""
    T = x.shape[0]
    xa, xb, xc = x[t0], x[min(t0 + 1, T - 1)], x[min(t0 + 2, T - 1)]
    xd, xe, xf = x[min(t0 + 3, T - 1)], x[min(t0 + 4, T - 1)], x[min(t0 + 5, T - 1)]
    xg, xh = x[min(t0 + 6, T - 1)], x[min(t0 + 7, T - 1)]
    a, b, c = _row2z(acc, t0), _row2z(acc, t0 + 1), _row2z(acc, t0 + 2)
    d, e, f = _row2z(acc, t0 + 3), _row2z(acc, t0 + 4), _row2z(acc, t0 + 5)
    g, h = _row2z(acc, t0 + 6), _row2z(acc, t0 + 7)
    for k in range(np.uintp(k0), np.uintp(k1)):  # unsigned: no wrap-around code for negative indices
        p = load_f32x16(panel, 64 * k), load_f32x16(panel, half + 64 * k)
        a, b, c = _fma2z(p, xa[k], a), _fma2z(p, xb[k], b), _fma2z(p, xc[k], c)
        d, e, f = _fma2z(p, xd[k], d), _fma2z(p, xe[k], e), _fma2z(p, xf[k], f)
        g, h = _fma2z(p, xg[k], g), _fma2z(p, xh[k], h)
    for n, v in enumerate((a, b, c, d, e, f, g, h)):
        _store2z(acc, t0 + n, v)


# the panel the compiled code's registers hold: 16 rows x 6 tokens on ymm, 32 x 8 on zmm (with 32
# ymm registers and no zmm the 4 x 4 tile stays)
PANEL_ROWS, PANEL_TOKENS = (PANEL_Z, PANEL_TZ) if ZMM else (PANEL, PANEL_T)
PANELS = ZMM or TILE == 3


@numba.njit(cache=True)
def gemm_panels(kind, w, x, out, r_lo, r_hi):
    """Rows r_lo..r_hi of out [T, R] from PANEL_ROWS-row panels (section doc)."""
    numba.literally(kind)
    T, K = x.shape
    half = 64 * (K + 15 - (K + 15) % 16)  # a 16-row panel: 64 bytes per column, Kp columns
    panel = np.empty(half * (PANEL_ROWS // 16), np.uint8)
    acc = np.empty(((T + PANEL_TOKENS - 1) // PANEL_TOKENS * PANEL_TOKENS, PANEL_ROWS), np.float32)
    for r0 in range(r_lo, r_hi, PANEL_ROWS):
        for q in range(PANEL_ROWS // 16):
            _pack_panel(kind, w, r0 + 16 * q, r_hi, panel[half * q:half * (q + 1)])
        acc[:] = 0.0
        for k0 in range(0, K, PANEL_K):
            for t0 in range(0, T, PANEL_TOKENS):
                if PANEL_ROWS == PANEL_Z:
                    _panel_tile_z(panel, half, x, t0, k0, min(K, k0 + PANEL_K), acc)
                else:
                    _panel_tile(panel, x, t0, k0, min(K, k0 + PANEL_K), acc)
        n = min(PANEL_ROWS, r_hi - r0)
        out[:, r0:r0 + n] = acc[:T, :n]


# --- the kernels of one type ------------------------------------------------------------------

@lru_cache(maxsize=None)
def float_kernels(kind: int) -> KernelSet:
    """The kernels of a float type (F32, F16, BF16: `kind` a constant in each). Float weights meet
    a float32 activation on every path, so gemv_exact is gemv."""
    kind = int(kind)  # a plain int: Numba types a captured int as a constant, an IntEnum not

    def dequant_rows(raw, row_ids, out):  # raw [R, n], row_ids [k] -> out [k, n] f32
        out[...] = to_f32(raw[row_ids], kind)
        return out

    def dequant_tile(raw, r0, out):  # out [k, n] f32 <- rows r0 .. r0+k of raw
        out[...] = to_f32(raw[r0:r0 + out.shape[0]], kind)
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemv(w, x, out):  # w [R, n] f32 / u16 bits, x [n] f32 -> out [R] f32
        for r in prange(w.shape[0]):
            out[r] = _gemv_row(kind, w[r], x)
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemm(w, x, out):  # w [R, n] f32 / u16 bits, x [T, n] f32 -> out [T, R] f32
        for c in prange(n_chunks(w.shape[0])):
            r_lo, r_hi = chunk_rows(c, w.shape[0])
            if PANELS and x.shape[0] >= PANEL_MIN_T:
                gemm_panels(kind, w, x, out, r_lo, r_hi)
            else:
                _gemm_chunk(kind, w, x, out, r_lo, r_hi)
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemv_rows(w, x, out):  # w [R, n] f32 / u16 bits, x [T, n] f32 -> out [T, R] f32, each row as gemv's
        for r in prange(w.shape[0]):  # a weight row stays in L1 while every activation row takes it
            for t in range(x.shape[0]):
                out[t, r] = _gemv_row(kind, w[r], x[t])
        return out

    return KernelSet(dequant_rows, dequant_tile, gemv, gemv, gemm, gemv_rows)
