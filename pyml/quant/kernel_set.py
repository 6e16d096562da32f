"""What quant dispatches through: the KernelSet of one weight type, in which its type id is a
compile-time constant.

The block types' math lives row by row in blocks32.py (32-value blocks) and kquants.py (256-value
superblocks), behind one row-level interface (dequant_row, decode_row, gemv_row, gemv_row_exact,
tile). Here those rows become the kernels a matrix needs, once for every block type:
the activation quantized once per call (activation.py, ggml's vec_dot_type), rows handed to
threads (`prange`) for T == 1, chunks of GEMM_CHUNK rows for T > 1 (32 rows of weights stay in
L2 while the activation tiles stream by). floats.py and interleaved.py make their own, of the
same shape.

No kernel branches on the type at run time: `kind` is a constant inside each closure (Numba
caches closures keyed by the values they capture), and each type's loops compile on their own.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple

import numba
import numpy as np
from numba import prange

from pyml.core.isa import ZMM
from pyml.quant import blocks32, kquants
from pyml.quant.activation import quantize_q8, quantize_rows_q8, quantize_rows_u8, sums32
from pyml.quant.ggml_types import Q4_K, Q5_K, Q6_K
from pyml.core.simd import FASTMATH, HAVE_AVX2, HAVE_VNNI, hsum


class KernelSet(NamedTuple):
    dequant_rows: Callable   # (raw, row_ids, out): scalar reference decoding of some rows
    dequant_tile: Callable   # (raw, r0, out): vectorised decoding of rows r0 .. r0 + len(out)
    gemv: Callable           # (w, x, out): T == 1 on the default path
    gemv_exact: Callable     # (w, x, out): T == 1, float32 activations
    gemm: Callable           # (w, x, out): T > 1 on the default path
    gemv_rows: Callable      # (w, x, out): 2 .. ROWS_MAX rows (a batched decode step), each with gemv's bits


GEMM_CHUNK = 32


@numba.njit
def n_chunks(rows):
    return (rows + GEMM_CHUNK - 1) // GEMM_CHUNK


@numba.njit
def chunk_rows(c, rows):  # (first, end) of chunk c
    return c * GEMM_CHUNK, min(rows, c * GEMM_CHUNK + GEMM_CHUNK)


@numba.njit
def _gemm_chunk(kind, superblocks, w, xq, xd, xs, xp, out, r_lo, r_hi):
    """Rows r_lo..r_hi of out [T, R] in register tiles of 2 weight rows x 4 activation rows, the
    activation tiles outside, so the chunk's weights stay in L2."""
    numba.literally(kind)
    numba.literally(superblocks)
    T = xq.shape[0]
    for t0 in range(0, T, 4):
        for ra in range(r_lo, r_hi, 2):
            rb = min(ra + 1, r_hi - 1)
            if superblocks:
                a0, a1, a2, a3, b0, b1, b2, b3 = kquants.tile(kind, w[ra], w[rb], xq, xd, xs, xp, t0, T)
            else:
                a0, a1, a2, a3, b0, b1, b2, b3 = blocks32.tile(kind, w[ra], w[rb], xq, xd, xs, xp, t0, T)
            out[t0, ra], out[t0, rb] = hsum(a0), hsum(b0)
            if t0 + 1 < T:
                out[t0 + 1, ra], out[t0 + 1, rb] = hsum(a1), hsum(b1)
            if t0 + 2 < T:
                out[t0 + 2, ra], out[t0 + 2, rb] = hsum(a2), hsum(b2)
            if t0 + 3 < T:
                out[t0 + 3, ra], out[t0 + 3, rb] = hsum(a3), hsum(b3)


@lru_cache(maxsize=None)
def block_kernels(kind: int) -> KernelSet:
    """The kernels of a block type (a GGML id of blocks32.py or kquants.py). w [R, row_bytes] uint8."""
    kind = int(kind)  # a plain int: Numba types a captured int as a constant, an IntEnum not
    superblocks = kind in (Q4_K, Q5_K, Q6_K)  # kquants.py's rows, else blocks32.py's

    @numba.njit(cache=True)
    def dequant_rows(raw, row_ids, out):  # raw [R, row_bytes], row_ids [n] -> out [n, n_cols] f32
        for i in range(row_ids.size):
            if superblocks:
                kquants.dequant_row(kind, raw[row_ids[i]], out[i])
            else:
                blocks32.dequant_row(kind, raw[row_ids[i]], out[i])
        return out

    @numba.njit(cache=True)  # serial: the exact path calls it between BLAS calls
    def dequant_tile(raw, r0, out):  # out [n, n_cols] f32 <- rows r0 .. r0+n of raw
        for i in range(out.shape[0]):
            if superblocks:
                kquants.decode_row(kind, raw[r0 + i], out[i])
            else:
                blocks32.decode_row(kind, raw[r0 + i], out[i])
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemv(w, x, out):  # w [R, row_bytes], x [n_cols] f32 -> out [R] f32
        xq, xd, xs, xp = quantize_q8(x)
        for r in prange(w.shape[0]):
            if superblocks:
                out[r] = kquants.gemv_row(kind, w[r], xq, xd, xs, xp)
            else:
                out[r] = blocks32.gemv_row(kind, w[r], xq, xd, xs, xp)
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemv_rows(w, x, out):  # w [R, row_bytes], x [T, n_cols] f32 -> out [T, R] f32, each row as gemv's
        xq, xd, xs, xp = quantize_rows_q8(x)  # each row as quantize_q8 quantizes it alone
        for r in prange(w.shape[0]):  # a weight row stays in L1 while every activation row takes it
            for t in range(x.shape[0]):
                if superblocks:
                    out[t, r] = kquants.gemv_row(kind, w[r], xq[t], xd[t], xs[t], xp[t])
                else:
                    out[t, r] = blocks32.gemv_row(kind, w[r], xq[t], xd[t], xs[t], xp[t])
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemv_exact(w, x, out):  # w [R, row_bytes], x [n_cols] f32 -> out [R] f32
        xsum = sums32(x)
        for r in prange(w.shape[0]):
            if superblocks:
                out[r] = kquants.gemv_row_exact(kind, w[r], x, xsum)
            else:
                out[r] = blocks32.gemv_row_exact(kind, w[r], x, xsum)
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemm(w, x, out):  # w [R, row_bytes], x [T, n_cols] f32 -> out [T, R] f32
        if kind == Q6_K and HAVE_AVX2:  # 8 (16) rows transcoded to int8 tiles per thread (kquants.py)
            y, xd = quantize_rows_u8(x)
            if ZMM:
                for g in prange((w.shape[0] + 15) // 16):
                    kquants.gemm_rows_q6k16(w, 16 * g, y, xd, out)
            elif not HAVE_VNNI:  # three tiles per activation quad (kquants.py)
                for u in prange((w.shape[0] + 23) // 24):
                    kquants.gemm_rows_q6k_triple(w, 24 * u, y, xd, out)
            else:
                for g in prange((w.shape[0] + 7) // 8):
                    kquants.gemm_rows_q6k(w, 8 * g, y, xd, out)
            return out
        xq, xd, xs, xp = quantize_rows_q8(x)
        for c in prange(n_chunks(w.shape[0])):
            r_lo, r_hi = chunk_rows(c, w.shape[0])
            _gemm_chunk(kind, superblocks, w, xq, xd, xs, xp, out, r_lo, r_hi)
        return out

    return KernelSet(dequant_rows, dequant_tile, gemv, gemv_exact, gemm, gemv_rows)
