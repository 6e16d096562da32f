"""Float weights: F32, F16 and BF16 matrices (rows, n_cols), converted to float32 on the fly.

Storage: float32; float16 (passed to the kernels as its uint16 bits: Numba has no float16);
uint16 holding bfloat16 bits (the top half of a float32). T == 1 runs a GEMV that streams the
weights once (F16/BF16 at 2 bytes per weight); T > 1 a GEMM in register tiles of 4 weight rows
x 4 activation rows (3 x 3 where the code has 16 vector registers), each weight vector widened to
float32 once per tile (vcvtph2ps for F16, a shift for BF16). Both are exact up to float32
summation order.
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np
from numba import prange

from pyml.core.isa import REGISTERS
from pyml.quant.ggml_types import F16, F32
from pyml.quant.kernel_set import KernelSet, chunk_rows, n_chunks
from pyml.quant.simd import (FASTMATH, add, bf16_to_f32, fma, half_to_f32, hsum, load_bf16x8, load_f16x8, load_f32x8,
                             prefetch, zeros_f32x8)



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
            _gemm_chunk(kind, w, x, out, r_lo, r_hi)
        return out

    return KernelSet(dequant_rows, dequant_tile, gemv, gemv, gemm)
