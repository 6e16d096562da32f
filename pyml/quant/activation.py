"""The activation side of the integer kernels: x quantized once per matmul to int8 blocks of 32.

Like ggml's vec_dot_type (Q8_0 / Q8_1 / Q8_K), the float32 activation row is quantized
once per call, then every weight row is dotted against it with integer multiply-adds and
one float multiply per block. Our format is finer than ggml's: one float32 scale per 32
values for every weight type (ggml: fp16 per 32 for Q8_0, float32 per 256 for Q8_K).

    q[j]  = round(x[j] / d_b)      int8 in [-127, 127], d_b = max|x in block b| / 127
    d[b]  float32                  the block's scale
    s[b]  = d_b * sum(q in block b)    float32: for the weight mins (Q4_1, Q5_1, Q4_K, Q5_K)
    p[i]  = q[2i] + q[2i+1]        int16: subtracts a code offset inside the integer dot,
                                   maddubs(code, q) - off * p == sum((code - off) * q) per pair

The exact path (`*_exact` kernels) uses `sums32(x)` instead: the float block sums of x itself.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from pyml.core.simd import FASTMATH
from pyml.core.simd_int import absmax32, round_store32, round_store32_u8


# fastmath=False said, not left out: a callee without the option inherits its caller's (Numba's
# flags inheritance), and the first caller to compile it fixes the cached machine code. From a
# fastmath caller d became amax x (1/127), 1 ulp off in ~5% of blocks, so results depended on which
# kernel a process (or the kernel cache) had compiled first.
@numba.njit(cache=True, fastmath=False)  # d and 1/d rounded exactly as documented (tests emulate it)
def _block_scale(x, b):  # (d, 1/d) of block b of x [n] f32
    amax = absmax32(x, b * 32)
    d = np.float32(amax / np.float32(127.0))
    return d, np.float32(np.float32(127.0) / amax) if amax > 0 else np.float32(0.0)


@numba.njit(cache=True, fastmath=False)
def quantize_block_q8(x, b, xq, xd, xs, xp):
    """Block b of x into xq, xd, xs, xp (quantize_row_q8's arrays); returns the block's code sum."""
    d, inv = _block_scale(x, b)
    xd[b] = d
    codes = round_store32(x, b * 32, inv, xq, b * 32, xp)
    xs[b] = d * np.float32(codes)
    return codes


@numba.njit(cache=True, fastmath=False)
def quantize_row_q8(x, xq, xd, xs, xp):  # x [n] -> xq [n] i8, xd [n/32], xs [n/32] f32, xp [n/2] i16
    for b in range(xd.size):
        quantize_block_q8(x, b, xq, xd, xs, xp)


@numba.njit(cache=True)
def quantize_q8(x):  # x [n] f32 -> (xq [n] i8, xd [n/32] f32, xs [n/32] f32, xp [n/2] i16)
    n = x.size
    xq = np.empty(n, np.int8)
    xd = np.empty(n // 32, np.float32)
    xs = np.empty(n // 32, np.float32)
    xp = np.empty(n // 2, np.int16)
    quantize_row_q8(x, xq, xd, xs, xp)
    return xq, xd, xs, xp


# Rows in parallel: a GEMM quantizes its activation before its own parallel loop, which on one thread
# left the other cores idle (docs/performance-journal.md, "Figures that were in the code").
@numba.njit(parallel=True, cache=True, fastmath=False)
def quantize_rows_q8(x):  # x [T, n] f32 -> (xq [T, n] i8, xd [T, n/32], xs [T, n/32] f32, xp [T, n/2] i16)
    T, n = x.shape
    xq = np.empty((T, n), np.int8)
    xd = np.empty((T, n // 32), np.float32)
    xs = np.empty((T, n // 32), np.float32)
    xp = np.empty((T, n // 2), np.int16)
    for t in prange(T):
        quantize_row_q8(x[t], xq[t], xd[t], xs[t], xp[t])
    return xq, xd, xs, xp


# What the GEMMs load whose weight codes are the signed operand (vpdpbusd's Q8_0 x8 tiles and Q6_K's
# transcoded ones, the AVX2 x8 triples): the codes + 128 as unsigned bytes, the block scales, and
# for the triples s and the code sums; no pair sums, and no pass of its own for the offset (each of
# which costs: the journal's "Figures that were in the code").
@numba.njit(cache=True, fastmath=False)
def _quantize_row_u8(x, y, xd, xs, qs):  # one row; xs and qs empty: no sums (LLVM then drops them)
    for b in range(xd.size):
        d, inv = _block_scale(x, b)
        xd[b] = d
        codes_sum = round_store32_u8(x, b * 32, inv, y, b * 32)
        if qs.size:
            qs[b] = codes_sum
            xs[b] = d * np.float32(codes_sum)


@numba.njit(parallel=True, cache=True, fastmath=False)
def _quantize_rows_u8(x, n_sums):  # the two below: xs, qs [T, n_sums], n_sums n/32 or 0 (none made)
    T, n = x.shape
    y = np.empty((T, n), np.uint8)
    xd = np.empty((T, n // 32), np.float32)
    xs = np.empty((T, n_sums), np.float32)
    qs = np.empty((T, n_sums), np.int32)
    for t in prange(T):
        _quantize_row_u8(x[t], y[t], xd[t], xs[t], qs[t])
    return y, xd, xs, qs


@numba.njit(cache=True)
def quantize_rows_u8(x):  # x [T, n] f32 -> (y [T, n] u8 = q + 128, xd [T, n/32] f32); q, xd as quantize_rows_q8
    y, xd, _, _ = _quantize_rows_u8(x, 0)
    return y, xd


@numba.njit(cache=True)
def quantize_rows_u8_sums(x):
    """x [T, n] f32 -> quantize_rows_u8's (y, xd), xs [T, n/32] f32 as quantize_rows_q8's, and qs
    [T, n/32] int32, the blocks' code sums."""
    return _quantize_rows_u8(x, x.shape[1] // 32)


@numba.njit(cache=True, fastmath=FASTMATH)
def sums32(x):  # x [n] f32 -> [n/32] f32: the block sums of x (exact path: weight offsets, mins)
    s = np.empty(x.size // 32, np.float32)
    for b in range(s.size):
        acc = np.float32(0.0)
        for j in range(32):
            acc += x[32 * b + j]
        s[b] = acc
    return s
