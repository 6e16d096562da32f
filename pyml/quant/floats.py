"""Float weights: F32, F16 and BF16 matrices (rows, n_cols), converted to float32 on the fly.

Storage: float32; float16 (passed to the kernels as its uint16 bits: Numba has no float16);
uint16 holding bfloat16 bits (the top half of a float32). T == 1 runs a GEMV that streams the
weights once (F16/BF16 at 2 bytes per weight); T > 1 a GEMM in register tiles of 2 weight rows
x 4 activation rows, each weight vector widened to float32 once per tile (vcvtph2ps for F16, a
shift for BF16). Both are exact up to float32 summation order.
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np
from numba import prange

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
def _tile(kind, wa, wb, x, t0, T):
    """8 dot products: weight rows wa, wb x activation rows t0..t0+3 (clamped to T-1), 8 columns
    per step; each weight vector is loaded (and widened to float32) once for the 4 rows."""
    numba.literally(kind)
    t1, t2, t3 = min(t0 + 1, T - 1), min(t0 + 2, T - 1), min(t0 + 3, T - 1)
    x0, x1, x2, x3 = x[t0], x[t1], x[t2], x[t3]
    a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    b0, b1, b2, b3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    n = x.shape[1]
    for i in range(n // 8):
        k = 8 * i
        va, vb = _load8(kind, wa, k), _load8(kind, wb, k)
        y = load_f32x8(x0, k)
        a0, b0 = fma(va, y, a0), fma(vb, y, b0)
        y = load_f32x8(x1, k)
        a1, b1 = fma(va, y, a1), fma(vb, y, b1)
        y = load_f32x8(x2, k)
        a2, b2 = fma(va, y, a2), fma(vb, y, b2)
        y = load_f32x8(x3, k)
        a3, b3 = fma(va, y, a3), fma(vb, y, b3)
    return a0, a1, a2, a3, b0, b1, b2, b3


@numba.njit
def _gemm_chunk(kind, w, x, out, r_lo, r_hi):
    numba.literally(kind)
    T, n = x.shape
    for t0 in range(0, T, 4):
        for ra in range(r_lo, r_hi, 2):
            rb = min(ra + 1, r_hi - 1)
            a0, a1, a2, a3, b0, b1, b2, b3 = _tile(kind, w[ra], w[rb], x, t0, T)
            for k, (a, b) in enumerate(((a0, b0), (a1, b1), (a2, b2), (a3, b3))):
                t = t0 + k
                if t < T:
                    sa, sb = hsum(a), hsum(b)
                    for j in range(n - n % 8, n):  # the tail: rows need not be multiples of 8
                        sa += _scalar(kind, w[ra, j]) * x[t, j]
                        sb += _scalar(kind, w[rb, j]) * x[t, j]
                    out[t, ra], out[t, rb] = sa, sb


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
