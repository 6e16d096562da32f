"""Float weights: F32, F16 and BF16 matrices (rows, n_cols), converted to float32 on the fly.

Storage: float32; float16 (passed to the kernels as its uint16 bits: Numba has no float16);
uint16 holding bfloat16 bits (the top half of a float32). T == 1 runs a jitted GEMV that
streams the weights once (F16/BF16 at 2 bytes per weight); T > 1 converts tiles of rows to
float32 and hands them to BLAS (F32 goes to BLAS directly).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from pyml.quant.simd import (FASTMATH, add, bf16_to_f32, fma, half_to_f32, hsum, load_bf16x8, load_f16x8, load_f32x8,
                             prefetch, store_f32x8, zeros_f32x8)

F32, F16, BF16 = 0, 1, 30  # GGML type ids: compile-time constants in the kernels below


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


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
def gemv(w, x, out, kind):  # w [R, n] f32 / u16 bits, x [n] f32 -> out [R] f32
    for r in prange(w.shape[0]):
        if kind == F32:
            out[r] = _gemv_row(F32, w[r], x)
        elif kind == F16:
            out[r] = _gemv_row(F16, w[r], x)
        else:
            out[r] = _gemv_row(BF16, w[r], x)
    return out


def to_f32(w: np.ndarray, kind: int) -> np.ndarray:
    """A float32 copy of stored float weights (any shape)."""
    if kind == F32:
        return np.array(w, dtype=np.float32)
    if kind == F16:
        return w.view(np.float16).astype(np.float32)
    return (w.astype(np.uint32) << 16).view(np.float32)


@numba.njit
def _convert_row(kind, w, y):  # y [n] f32 <- w [n] stored
    numba.literally(kind)
    n = y.size
    for i in range(n // 8):
        store_f32x8(y, 8 * i, _load8(kind, w, 8 * i))
    for k in range(n - n % 8, n):
        y[k] = _scalar(kind, w[k])


@numba.njit(parallel=True, cache=True)
def to_f32_tile(w, r0, out, kind):  # out [n, n_cols] f32 <- rows r0 .. r0+n of w
    for i in prange(out.shape[0]):
        if kind == F32:
            _convert_row(F32, w[r0 + i], out[i])
        elif kind == F16:
            _convert_row(F16, w[r0 + i], out[i])
        else:
            _convert_row(BF16, w[r0 + i], out[i])
    return out
